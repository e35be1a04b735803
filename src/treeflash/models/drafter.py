"""DFlash drafter (z-lab checkpoint format) with a per-request cache of committed context K/V.

The drafter proposes a whole block `[bonus, MASK x (B-1)]` in one pass. The target's
tapped hidden states are fused (`fc` -> `hidden_norm`) and injected as extra keys/values
into every layer; because context rows are never queries, their K/V depend only on their
own feature and are computed once, when the token is committed (`extend`). The block's
own K/V live only inside `propose`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from treeflash import kernels
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.kernels.reference import drafter_block_mask, drafter_sdpa
from treeflash.models.drafter_cache import DrafterCache, KVBufferPool, LayerKV
from treeflash.models.layers import MLP, RMSNorm, Rotary, fused
from treeflash.runtime import DEFAULT, RuntimeOptions

# Checkpoint tensors that are not the drafter's own (it uses the target's embedding and head).
_IGNORED_KEYS = ("rotary_emb.inv_freq", "embed_tokens.weight", "lm_head.weight")


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, options: RuntimeOptions = DEFAULT):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, options)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, options)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary):
        """x [..., T, hidden] -> k, v [..., T, Hkv, D] (k normed and rotated)."""
        k = self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        return rotary.apply(k, cos, sin, norm=self.k_norm), v



class DrafterMLP(MLP):
    """The target's SwiGLU MLP (same tensors), plus the fused proposal's form: gate and up as
    one GEMM, then silu(gate) * up in one launch (kernels.silu_mul), then down."""

    def gate_up_weight(self) -> torch.Tensor:
        """gate_proj and up_proj stacked: [2 inter, hidden] (`_stacked`)."""
        return _stacked(self, "_gate_up_cache", (self.gate_proj, self.up_proj))[0]

    def fused_forward(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        """forward(x) in three launches (the bf16 sums of the stacked GEMM may be ordered
        differently; every rounding is torch's)."""
        gu = F.linear(x, self.gate_up_weight())
        inter = self.gate_proj.out_features
        return self.down_proj(kernels.silu_mul(gu[..., :inter], gu[..., inter:], impl=impl))


def _key(tensors: Sequence[torch.Tensor]) -> list:
    """Each tensor's address, version counter (an inference tensor has none: its address
    alone), device, dtype and shape: a stack built from them is stale when this changes."""
    key = []
    for t in tensors:
        try:
            key.append((t.data_ptr(), t._version, t.device, t.dtype, tuple(t.shape)))
        except RuntimeError:  # an inference tensor has no version counter
            key.append((t.data_ptr(), None, t.device, t.dtype, tuple(t.shape)))
    return key


def _rehome(parts: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """One buffer of `shape` holding `parts` (in order, flattened) and the parts' parameters
    pointed at their slices of it (`.data`): the stack and the per-projection weights share
    one copy. Built outside inference mode (an inference buffer would turn the parameters
    into inference tensors, which training and load_state_dict could not update in place).
    In-place updates of a parameter (an optimizer step, load_state_dict) then write the
    buffer too; a parameter given a new tensor leaves it, and the next `_key` sees that.
    Parts of mixed dtypes or devices are not re-homed (that would change a parameter): they get
    a promoted copy, as torch.cat makes."""
    if any(t.dtype != parts[0].dtype or t.device != parts[0].device for t in parts):
        return torch.cat([t.detach().reshape(-1) for t in parts]).view(shape)
    with torch.inference_mode(False), torch.no_grad():
        buf = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        flat, off = buf.view(-1), 0
        for t in parts:
            n = t.numel()
            flat[off:off + n].copy_(t.detach().reshape(-1))
            t.data = flat[off:off + n].view(t.shape)
            off += n
    return buf


def _stacked(owner: nn.Module, name: str, linears: Sequence[nn.Linear], groups: int = 1):
    """(weight, bias or None) of `linears` concatenated along their outputs, cached on `owner`
    and built again when any of their tensors changes (`_key`), as moe.Gate's float32 router
    weight. The linears' parameters are re-homed into the stack (`_rehome`): the stack costs
    no memory beside them. groups > 1: shaped [groups, rows / groups, in] (and bias
    [groups, rows / groups]), e.g. one [q; k; v] block a layer (`_layered_qkv`)."""
    tensors = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != _key(tensors):
        rows = sum(lin.out_features for lin in linears)
        lead = (groups, rows // groups) if groups > 1 else (rows,)
        weight = _rehome([lin.weight for lin in linears], (*lead, linears[0].in_features))
        bias = None if linears[0].bias is None else _rehome([lin.bias for lin in linears], lead)
        cached = owner.__dict__[name] = (_key(tensors), weight, bias)
    return cached[1], cached[2]


def _layers_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight[l], bias[l]) for every l as one batched GEMM: x [T, in], weight
    [L, out, in] (any layer stride), bias [L, out] or None -> [L, T, out]. The bias goes in
    the GEMM (baddbmm), as F.linear's addmm: one rounding, the per-layer results' bits."""
    xs = x.expand(weight.shape[0], *x.shape)
    if bias is None:
        return torch.bmm(xs, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None], xs, weight.transpose(1, 2))


def _layered_qkv(owner: nn.Module, attns: Sequence[DrafterAttention]):
    """(weight [L, (Hq + 2 Hkv) D, hidden], bias [L, (Hq + 2 Hkv) D] or None): every layer's
    q_proj, k_proj, v_proj stacked, layer after layer, with the projections' parameters
    re-homed into it (`_stacked`). Layer l's [q; k; v] block is contiguous (the proposal's one
    qkv GEMM a layer, `DFlashDrafter._attend_fused`) and [:, Hq D:] is every layer's k and v as
    one strided operand (the append's one batched k/v GEMM, `DFlashDrafter._kv_weight`): one
    copy of the weights serves both."""
    lins = [m for a in attns for m in (a.q_proj, a.k_proj, a.v_proj)]
    return _stacked(owner, "_qkv_home", lins, groups=len(attns))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.self_attn = DrafterAttention(cfg, options)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)


class DFlashDrafter(nn.Module):
    """z-lab DFlash drafter; uses the target's embedding and lm_head weights ([V, hidden]).
    `options`: which implementation each fused step runs (`runtime.RuntimeOptions`)."""

    # propose(static=True / full=True) and extend_static(count=...): fixed shapes, counts read on
    # the device (speculative/draft_graphs.py; the overlapped step of speculative/decoder.py)
    supports_static_propose = True

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 options: RuntimeOptions = DEFAULT):
        super().__init__()
        _check_heads(cfg, embed_weight, lm_head_weight)
        self.cfg = cfg
        self.options = options
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, options)
        self.layers = nn.ModuleList(DrafterLayer(cfg, options) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, options)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, interleave=False, options=options)
        # Shared with the target, not saved with the drafter.
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight, persistent=False)
        # Attention kernel: None = `options.drafter_attention`, else Triton on CUDA and torch
        # otherwise (tests pin it here).
        self.impl: str | None = None

    # ---- facts the engine needs ------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_state_dict(
        cls,
        cfg: DrafterConfig,
        state_dict: dict[str, torch.Tensor],
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        options: RuntimeOptions = DEFAULT,
    ) -> DFlashDrafter:
        """Build from z-lab tensor names (an optional `model.` prefix is accepted)."""
        dtype = dtype or embed_weight.dtype
        device = device or embed_weight.device
        model = cls(cfg, embed_weight.to(device, dtype), lm_head_weight.to(device, dtype), options)
        sd = {_strip(k): v for k, v in state_dict.items() if _strip(k) not in _IGNORED_KEYS}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"drafter checkpoint: missing tensors {sorted(missing)}, "
                f"unexpected tensors {sorted(unexpected)}"
            )
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        target_cfg: ModelConfig | None = None,
        options: RuntimeOptions = DEFAULT,
    ) -> DFlashDrafter:
        """Load config.json + model.safetensors (or a sharded index) from a directory.

        With `target_cfg`, refuses a drafter that does not fit that target (ValueError).
        """
        cfg = DrafterConfig.from_hf(path)
        if target_cfg is not None:
            cfg.check_fits(target_cfg)
        return cls.from_state_dict(
            cfg, _read_safetensors(Path(path)), embed_weight, lm_head_weight, device, dtype, options
        )

    # ---- cache -----------------------------------------------------------------------
    def new_cache(self, prompt_ids: Sequence[int] | None = None) -> DrafterCache:
        """An empty cache for one request (`prompt_ids` is unused; test drafters read it)."""
        p = self.fc.weight
        c = self.cfg
        if getattr(self, "_pool", None) is None:
            self._pool = KVBufferPool()
        return DrafterCache(
            [
                LayerKV(c.num_key_value_heads, c.head_dim, c.window(i), p.device, p.dtype, self._pool, i)
                for i in range(c.num_hidden_layers)
            ]
        )

    def release_cache(self, cache: DrafterCache) -> None:
        """A finished request's cache: its buffers serve the next request (KVBufferPool)."""
        cache.release()

    @torch.no_grad()
    def extend(
        self, cache: DrafterCache, features: torch.Tensor, positions: torch.Tensor | None = None,
        impl: str | None = None,
    ) -> None:
        """Append committed rows: features [T, n_taps*hidden] at positions [T].

        positions default to cache.seq_len + arange(T); they must continue the cache's
        run (not checked on device, to avoid a host sync): the fused path reads only the first.
        impl: as extend_static's (None: the fused append where it applies, "torch": per layer).
        """
        t = features.shape[0]
        kernel = None if impl == "torch" or t == 0 else self._extend_kernel(cache, features)
        if kernel is not None:  # extend_static's path, masked to all t rows: append()'s slots
            firsts = cache.reserve(t)
            dev = features.device
            head = [] if positions is not None else [cache.seq_len]
            meta = torch.tensor([*head, t, *firsts], dtype=torch.long, device=dev)  # one copy
            start = meta[:1] if positions is None else positions.reshape(-1)[:1]
            self._extend_static_fused(cache, features, start, meta[len(head) + 1:],
                                      meta[len(head):len(head) + 1], kernel)
            cache.advance(t)
            return
        if positions is None:
            positions = torch.arange(cache.seq_len, cache.seq_len + t, device=features.device)
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)  # [T, D/2]
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            k, v = layer.self_attn.kv(ctx, cos, sin, self.rotary)  # [T, Hkv, D]
            kv.append(k.transpose(0, 1), v.transpose(0, 1), positions)
        cache.seq_len += t

    @torch.no_grad()
    def extend_static(self, cache: DrafterCache, features: torch.Tensor, start: torch.Tensor,
                      first: torch.Tensor, count: torch.Tensor | None = None, impl: str | None = None) -> None:
        """extend() with device-side slots: features [T, taps*hidden] at positions start + 0..T-1
        (start [1]), layer i's rows into slots first[i] + 0..T-1. No host value enters the
        computation, so it can be captured; the caller reserves before and advances after.

        count [1] (device): append only the first count rows (LayerKV.write_at), so a step
        can queue its append before the host has learned how many drafts were accepted
        (the overlapped step, speculative/decoder.py): T is then the block size, whatever count is.

        impl: None = the fused append where fused kernels apply (inference, `layers.fused`):
        fc, hidden_norm, one batched GEMM for every layer's k and v (`_kv_weight`) and one launch for
        the norms, rotations and cache writes (`kernels.drafter_kv_write`); "torch" = the
        per-layer ops below (what training and `options.fused_norm` off run)."""
        kernel = None if impl == "torch" else self._extend_kernel(cache, features)
        if kernel is not None:
            self._extend_static_fused(cache, features, start, first, count, kernel)
            return
        t = features.shape[0]
        positions = start + torch.arange(t, device=features.device)
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, cache.layers, strict=True)):
            k, v = layer.self_attn.kv(ctx, cos, sin, self.rotary)
            kv.write_at(first[i], k.transpose(0, 1), v.transpose(0, 1), positions,
                        None if count is None else count[0])

    @torch.no_grad()
    def extend_static_batch(self, caches: Sequence[DrafterCache], features: torch.Tensor, start: torch.Tensor,
                            first: torch.Tensor, count: torch.Tensor) -> None:
        """extend_static(caches[i], features[i], start[i:i+1], first[:, i], count[i:i+1]) for each
        request of a batch (features [B, T, taps*hidden], start [B], first [layers, B], count [B],
        on the device). Fused: fc, hidden_norm and the k/v GEMM once for the batch's B*T rows,
        then each request's cache write (B + 3 launches, not 4B: at batch 64 the per-request
        appends were ~250 eager launches a step); else request by request."""
        kernel = self._extend_kernel(caches[0], features) if len(caches) > 1 else None
        if kernel is None or not all(self._cache_fits(c) for c in caches[1:]):
            for i, cache in enumerate(caches):
                self.extend_static(cache, features[i], start[i:i + 1], first[:, i], count[i:i + 1])
            return
        b, t = features.shape[:2]
        ctx = self.hidden_norm(self.fc(features.flatten(0, 1).to(self.fc.weight.dtype)))  # [B*T, hidden]
        kv = _layers_linear(ctx, *self._kv_weight())  # [L, B*T, 2 Hkv D]: request i's rows i*T..
        for i, cache in enumerate(caches):
            layers = [(c.k, c.v, c.pos, layer.self_attn.k_norm.weight, c.window is not None)
                      for layer, c in zip(self.layers, cache.layers, strict=True)]
            kernels.drafter_kv_write(kv[:, i * t:(i + 1) * t], start[i:i + 1], first[:, i], count[i:i + 1], layers,
                                     self.rotary.inv_freq, self.rotary.scale, self.rotary.interleave,
                                     self.layers[0].self_attn.k_norm.eps, impl=kernel)

    def _extend_kernel(self, cache: DrafterCache, features: torch.Tensor) -> str | None:
        """The kernels.drafter_kv_write impl for a fused extend_static, or None for the per-layer
        torch ops: fused kernels allowed (`layers.fused`: inference, not opted out) and one
        dtype across the weights, k_norms and cache buffers (what the kernel assumes)."""
        attn = [layer.self_attn for layer in self.layers]
        params = [p for a in attn for m in (a.k_proj, a.v_proj, a.k_norm) for p in m.parameters()]
        impl = fused(self.options, features, self.fc.weight, *params)
        dt = self.fc.weight.dtype
        if impl is None or dt not in (torch.bfloat16, torch.float16, torch.float32):
            return None
        if any(p.dtype != dt for p in params) or len({a.k_norm.eps for a in attn}) != 1:
            return None
        if not self.rotary.inv_freq.is_floating_point() or self.rotary.inv_freq.dtype == torch.float64:
            return None
        return impl if self._cache_fits(cache) else None

    def _cache_fits(self, cache: DrafterCache) -> bool:
        """The cache's buffers are of the weights' dtype and contiguous (what the fused write assumes)."""
        dt = self.fc.weight.dtype
        return all(b.dtype == dt and b.is_contiguous() for kv in cache.layers for b in (kv.k, kv.v))

    def _kv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer's k_proj then v_proj weight [L, 2 Hkv D, hidden] (and bias [L, 2 Hkv D]):
        a strided view of the shared q/k/v stack (`_layered_qkv`), the fused extend_static's
        one batched k/v GEMM."""
        attns = [layer.self_attn for layer in self.layers]
        w, b = _layered_qkv(self, attns)
        q_rows = attns[0].q_proj.out_features
        return w[:, q_rows:], None if b is None else b[:, q_rows:]

    def _extend_static_fused(self, cache: DrafterCache, features: torch.Tensor, start: torch.Tensor,
                             first: torch.Tensor, count: torch.Tensor | None, impl: str) -> None:
        """extend_static in ~4 launches: fc, hidden_norm, the k/v GEMM of every layer, and
        kernels.drafter_kv_write (positions, cos/sin, k_norm, rotary, slots and stores)."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [T, hidden]
        w, b = self._kv_weight()
        kv = _layers_linear(ctx, w, b)  # [L, T, 2 Hkv D]
        layers = [(c.k, c.v, c.pos, layer.self_attn.k_norm.weight, c.window is not None)
                  for layer, c in zip(self.layers, cache.layers, strict=True)]
        kernels.drafter_kv_write(kv, start, first, count, layers, self.rotary.inv_freq, self.rotary.scale,
                                 self.rotary.interleave, self.layers[0].self_attn.k_norm.eps, impl=impl)

    # ---- block proposal --------------------------------------------------------------
    @torch.no_grad()
    def propose(
        self,
        caches: Sequence[DrafterCache],
        bonus: torch.Tensor,
        start_pos: torch.Tensor,
        block_size: int | None = None,
        static: bool = False,
        full: bool = False,
    ) -> torch.Tensor:
        """Logits [B, bs-1, V] for block slots 1..bs-1 (slot k predicts position start+k).

        bonus [B] long: slot 0 of each block; start_pos [B] long: its position, which must
        equal that request's cache.seq_len (the cache holds positions < start only).
        static (one request): attend over every cache slot, unused ones masked, so the
        shapes and addresses depend only on the cache's capacity (CUDA-graph capturable).
        full (any batch; static implies it): attend over every slot too, so the proposal
        reads no host count of valid slots: it may be queued behind an append whose length
        the host has not learned yet (the overlapped step, speculative/decoder.py).
        """
        if static and len(caches) != 1:
            raise ValueError("a static proposal is for one request")
        bs = block_size or self.cfg.block_size
        if not 2 <= bs:
            raise ValueError(f"block_size must be >= 2, got {bs}")
        impl = self._fused_impl()
        if impl is not None:
            return self._propose_fused(caches, bonus, start_pos, bs, static or full, impl)
        dev = self.embed_weight.device
        block = torch.full((len(caches), bs), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = bonus
        x = F.embedding(block, self.embed_weight)  # [B, Q, h]
        if self.cfg.input_embedding_scale != 1.0:  # x * 1.0 == x: no launch for it
            x = x * self.cfg.input_embedding_scale
        q_pos = start_pos.to(dev)[:, None] + torch.arange(bs, device=dev)  # [B, Q]
        cos, sin = self.rotary.cos_sin(q_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v, ctx_pos = _gather_context(caches, i, x.dtype, dev, full=static or full)
            x = x + self._attend(i, layer.input_layernorm(x), ctx_k, ctx_v, ctx_pos, q_pos, cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(self.norm(x[:, 1:]))

    def _fused_impl(self) -> str | None:
        """The fused proposal's kernel impl (layers.fused: Triton on CUDA at inference, or what
        tests pin), or None for the plain torch ops: also when a norm's weight or inv_freq is
        not of the model's dtype family the fused kernels assume (all one dtype, as loaded)."""
        impl = fused(self.options, self.embed_weight)
        if impl is None:
            return None
        dt = self.embed_weight.dtype
        norms = [self.norm] + [n for layer in self.layers for n in (
            layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)]
        if any(n.weight.dtype != dt for n in norms) or not self.rotary.inv_freq.is_floating_point():
            return None
        return impl

    def _propose_fused(self, caches, bonus, start_pos, bs: int, full: bool, impl: str) -> torch.Tensor:
        """propose() in fewer launches (CUDA, inference): the block's embedding from the bonus row
        and a view of the mask token's row; one GEMM for q, k, v and one launch normalising and
        rotating q and k in place, cos/sin computed inside from the positions (no tables); each
        residual add in the next norm's launch (RMSNorm.add_forward); gate and up as one GEMM and
        silu * up in one launch. The same roundings as the torch path (each rounded where torch
        rounds); only the stacked GEMMs may sum in another order."""
        dev = self.embed_weight.device
        b, cfg = len(caches), self.cfg
        mask_row = self.embed_weight[cfg.mask_token_id]  # a view: no launch
        x = torch.cat([F.embedding(bonus.to(dev)[:, None], self.embed_weight),
                       mask_row.expand(b, bs - 1, mask_row.shape[0])], dim=1)  # [B, Q, h]
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        q_pos = start_pos.to(dev)[:, None] + self._block_offsets(bs, dev)  # [B, Q]
        h = self.layers[0].input_layernorm(x)
        qkv = _layered_qkv(self, [layer.self_attn for layer in self.layers])  # checked once a proposal
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v, ctx_pos = _gather_context(caches, i, x.dtype, dev, full=full)
            a = self._attend_fused(i, h, ctx_k, ctx_v, ctx_pos, q_pos, impl, qkv)
            h, x = layer.post_attention_layernorm.add_forward(a, x)  # norm(x + attn), x + attn
            m = layer.mlp.fused_forward(h, impl)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = nxt.add_forward(m, x)
        # rows are normalised independently: row 0's is unused. 2-D into the head: matmul takes
        # a [B, Q-1, h] slice of [B, Q, h] (not viewable as one 2-D block) to bmm
        return self._logits(h[:, 1:].reshape(-1, h.shape[-1])).unflatten(0, (b, bs - 1))

    def _block_offsets(self, bs: int, dev: torch.device) -> torch.Tensor:
        """arange(bs) on dev, made once (the first, eager, proposal: before any capture)."""
        cache = self.__dict__.setdefault("_offsets", {})
        if (bs, dev) not in cache:
            cache[(bs, dev)] = torch.arange(bs, device=dev)
        return cache[(bs, dev)]

    def _attend_fused(self, i: int, h, ctx_k, ctx_v, ctx_pos, q_pos, impl: str, qkv_home) -> torch.Tensor:
        """_attend with q, k, v from one GEMM (layer i's block of the shared stack `qkv_home`,
        `_layered_qkv`) and q, k normalised and rotated in one launch, in place in the GEMM's
        output (column slices of it are the heads: no copies)."""
        attn = self.layers[i].self_attn
        hq, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        weight, bias = qkv_home
        qkv = F.linear(h, weight[i], None if bias is None else bias[i])  # [B, Q, (Hq + 2 Hkv) D]
        q = qkv[..., : hq * d].unflatten(-1, (hq, d))
        k = qkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d))
        v = qkv[..., (hq + hkv) * d :].unflatten(-1, (hkv, d))
        kernels.qk_norm_rope(q, k, q_pos, self.rotary.inv_freq, attn.q_norm.weight, attn.k_norm.weight,
                             attn.q_norm.eps, attn.k_norm.eps, self.rotary.interleave, self.rotary.scale,
                             out_q=q, out_k=k, impl=impl)
        o = self._attention(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx_k, ctx_v,
                            ctx_pos, q_pos)
        return attn.o_proj(o.transpose(1, 2).flatten(2))  # [B, Q, hidden]

    def _attend(self, i: int, h, ctx_k, ctx_v, ctx_pos, q_pos, cos, sin) -> torch.Tensor:
        """Layer i's attention of the block h [B, Q, hidden] over the context K/V [B, Hkv, L, D]
        (slot positions ctx_pos [B, L], -1 = padding) and the block itself (q_pos [B, Q])."""
        attn = self.layers[i].self_attn
        q = attn.q_proj(h).unflatten(-1, (attn.n_heads, attn.head_dim))
        q = self.rotary.apply(q, cos, sin, norm=attn.q_norm).transpose(1, 2)  # [B, Hq, Q, D]
        k, v = attn.kv(h, cos, sin, self.rotary)  # [B, Q, Hkv, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Q, D]
        o = self._attention(i, q, k, v, ctx_k, ctx_v, ctx_pos, q_pos)
        return attn.o_proj(o.transpose(1, 2).flatten(2))  # [B, Q, hidden]

    def _attention(self, i: int, q, k, v, ctx_k, ctx_v, ctx_pos, q_pos) -> torch.Tensor:
        """q [B, Hq, Q, D] over the context and the block's own k, v [B, Hkv, Q, D] -> [B, Hq, Q, D]."""
        scale = self.layers[i].self_attn.head_dim**-0.5
        impl = self.impl or self.options.drafter_attention or ("triton" if q.is_cuda else "torch")
        if impl == "torch":  # the mask through _block_mask: test drafters override it
            return drafter_sdpa(q, ctx_k, ctx_v, k, v, self._block_mask(i, q_pos, ctx_pos), scale)
        # reads the context once, in place (kernels/drafter_attn.py)
        return kernels.drafter_attention(q, ctx_k, ctx_v, k, v, ctx_pos, q_pos, self.cfg.is_causal_layer(i),
                                         self.cfg.window(i), scale, impl=impl)

    def _block_mask(self, layer: int, q_pos: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """[B, Q, L+Q] bool. Context rows (pos -1 = padding) precede the block's rows."""
        return drafter_block_mask(q_pos, ctx_pos, self.cfg.is_causal_layer(layer), self.cfg.window(layer))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.lm_head_weight)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _gather_context(
    caches: Sequence[DrafterCache], layer: int, dtype: torch.dtype, device: torch.device, full: bool = False
):
    """Pad the requests' context K/V of one layer: [B, Hkv, L, D] x2 and pos [B, L] (-1 pads).

    One request (the latency case) gets views of its cache, no copy; a batch is copied into
    one padded tensor (a paged drafter cache shared by the batch would avoid that: issue 7):
    one stack per tensor where every view has one length (full views of caches presized
    alike, the overlapped step's), else a zeroed buffer and three copies per request (a
    batch of 8 over the shipped drafter's 2 layers: 6 launches against 54).
    """
    views = [c.layers[layer].full_view() if full else c.layers[layer].view() for c in caches]
    if len(views) == 1:
        kb, vb, pb = views[0]
        return kb.unsqueeze(0).to(dtype), vb.unsqueeze(0).to(dtype), pb.unsqueeze(0)
    if len({v[0].shape[1] for v in views}) == 1:
        return tuple(torch.stack([v[j] for v in views]).to(dtype if j < 2 else torch.long) for j in range(3))
    n_max = max(v[0].shape[1] for v in views)
    hkv, d = views[0][0].shape[0], views[0][0].shape[2]
    k = torch.zeros(len(caches), hkv, n_max, d, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    pos = torch.full((len(caches), n_max), -1, dtype=torch.long, device=device)
    for b, (kb, vb, pb) in enumerate(views):
        n = kb.shape[1]
        k[b, :, :n], v[b, :, :n], pos[b, :n] = kb, vb, pb
    return k, v, pos


def _check_heads(cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor) -> None:
    if embed.dim() != 2 or embed.shape[1] != cfg.hidden_size:
        raise ValueError(f"embed_weight must be [V, {cfg.hidden_size}], got {list(embed.shape)}")
    if head.shape != embed.shape:
        raise ValueError(f"lm_head_weight {list(head.shape)} != embed_weight {list(embed.shape)}")
    if cfg.vocab_size is not None and cfg.vocab_size != embed.shape[0]:
        raise ValueError(
            f"drafter vocab_size {cfg.vocab_size} != target vocabulary {embed.shape[0]}"
        )
    if not 0 <= cfg.mask_token_id < embed.shape[0]:
        raise ValueError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target "
            f"vocabulary (0..{embed.shape[0] - 1})"
        )


def _strip(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(path / shard))
    return out
