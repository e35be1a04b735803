"""DFlash drafter (z-lab checkpoint format) with a per-request cache of committed context K/V.

The drafter proposes a whole block `[bonus, MASK x (B-1)]` in one pass. The target's
tapped hidden states are fused (`fc` -> `hidden_norm`) and injected as extra keys/values
into every layer; because context rows are never queries, their K/V depend only on their
own feature and are computed once, when the token is committed (`extend`). The block's
own K/V live only inside `propose`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from treeflash import kernels
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.kernels.reference import drafter_block_mask, drafter_sdpa
from treeflash.models.layers import MLP, RMSNorm, Rotary

# Checkpoint tensors that are not the drafter's own (it uses the target's embedding and head).
_IGNORED_KEYS = ("rotary_emb.inv_freq", "embed_tokens.weight", "lm_head.weight")


class LayerKV:
    """Committed context K/V of one layer of one request.

    Full layers keep every position in a buffer that grows by doubling. Sliding layers keep
    a ring of the last W-1 positions: a block query at p >= start sees context j iff
    p - j < W, so nothing older than start-(W-1) is ever visible. Order inside the ring
    does not matter to attention; `pos` records each slot's absolute position for the mask.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        window: int | None,
        device: torch.device,
        dtype: torch.dtype,
        pool: KVBufferPool | None = None,
        layer: int = 0,
    ):
        self.window = window
        self.pool, self.layer = pool, layer
        self._shape = (n_kv_heads, head_dim, device, dtype)
        cap = 16 if window is None else max(window - 1, 0)
        self.k, self.v, self.pos = self._buffers(cap)
        self.n = 0  # valid slots
        self.head = 0  # next ring slot (sliding layers)

    def _buffers(self, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [Hkv, cap, D] and pos [cap] = -1: a finished request's (the pool) or new."""
        h, d, device, dtype = self._shape

        def fresh():
            k = torch.zeros(h, cap, d, device=device, dtype=dtype)
            return k, torch.zeros_like(k), torch.full((cap,), -1, dtype=torch.long, device=device)

        return fresh() if self.pool is None else self.pool.take((self.layer, cap), fresh)

    def release(self) -> None:
        """Hand the buffers to the pool (the request is done; this LayerKV is dead)."""
        if self.pool is not None:
            self.pool.give((self.layer, self.capacity), (self.k, self.v, self.pos))
        self.k = self.v = self.pos = None

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v [Hkv, T, D]; pos [T] absolute positions, increasing."""
        if self.window is None:
            self._append_full(k, v, pos)
        else:
            self._append_ring(k, v, pos)

    def _append_full(self, k, v, pos) -> None:
        t = k.shape[1]
        self.reserve(t)
        self.k[:, self.n : self.n + t] = k
        self.v[:, self.n : self.n + t] = v
        self.pos[self.n : self.n + t] = pos
        self.n += t

    def _append_ring(self, k, v, pos) -> None:
        cap, t = self.capacity, k.shape[1]
        if cap == 0:
            return
        if t >= cap:
            self.k[:], self.v[:], self.pos[:] = k[:, -cap:], v[:, -cap:], pos[-cap:]
            self.head, self.n = 0, cap
            return
        idx = (self.head + torch.arange(t, device=self.k.device)) % cap
        self.k[:, idx], self.v[:, idx], self.pos[idx] = k, v, pos
        self.head = (self.head + t) % cap
        self.n = min(self.n + t, cap)

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [Hkv, n, D] and pos [n] of the valid slots."""
        return self.k[:, : self.n], self.v[:, : self.n], self.pos[: self.n]

    # ---- the static append (CUDA graphs): slots from a device index, bookkeeping on the host
    def reserve(self, t: int) -> int:
        """Make room for t rows (a full layer grows now, on the host) and return the first
        slot they go to: n for a full layer, the ring head for a sliding one."""
        if self.window is None:
            if self.n + t > self.capacity:
                old, n = (self.k, self.v, self.pos), self.n
                cap = max(2 * self.capacity, self.n + t)
                self.k, self.v, self.pos = self._buffers(cap)
                self.k[:, :n], self.v[:, :n], self.pos[:n] = old[0][:, :n], old[1][:, :n], old[2][:n]
                if self.pool is not None:
                    self.pool.give((self.layer, old[0].shape[1]), old)
            return self.n
        return self.head

    def write_at(self, first: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 count: torch.Tensor | None = None) -> None:
        """k, v [Hkv, T, D] into slots first + 0..T-1 (mod the ring), first a device scalar.

        count (a device scalar, 1 <= count <= T): append only rows 0..count-1, each to the slot
        append() of those rows would give it, and leave every other slot as it was. T then
        stays fixed whatever count is, so one CUDA graph serves any count; a full layer must
        have room for all T rows (reserve(T))."""
        if self.capacity == 0:
            return
        if count is None:
            idx = first + torch.arange(k.shape[1], device=k.device)
            if self.window is not None:
                idx = idx % self.capacity
        else:
            idx, src, keep = self._masked_slots(first, k.shape[1], count)
            if src is not None:
                k, v, pos = k[:, src], v[:, src], pos[src]
            k = torch.where(keep[None, :, None], k, self.k[:, idx])
            v = torch.where(keep[None, :, None], v, self.v[:, idx])
            pos = torch.where(keep, pos, self.pos[idx])
        self.k.index_copy_(1, idx, k)
        self.v.index_copy_(1, idx, v)
        self.pos.index_copy_(0, idx, pos)

    def _masked_slots(self, first: torch.Tensor, t: int, count: torch.Tensor):
        """(slots, source rows or None for rows 0..t-1 in order, keep) of a count-of-t append
        from slot `first`: distinct slots (at most the ring's capacity), so writes never collide."""
        j = torch.arange(t if self.window is None else min(t, self.capacity), device=first.device)
        if self.window is None:
            return first + j, None, j < count
        slot = (first + j) % self.capacity
        wrap = count >= self.capacity  # append() keeps the last `capacity` rows, in slots 0..cap-1
        return slot, torch.where(wrap, slot + count - self.capacity, j), wrap | (j < count)

    def advance(self, t: int) -> None:
        """The host's side of a static append of t rows (what append() does to n / head)."""
        if self.window is None:
            self.n += t
        elif self.capacity:
            self.head = 0 if t >= self.capacity else (self.head + t) % self.capacity
            self.n = min(self.n + t, self.capacity)

    def full_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slot (capacity): unused ones have pos -1 and are masked out. Fixed shapes
        and addresses until the buffer grows, so a captured proposal can read it in place."""
        return self.k, self.v, self.pos


class KVBufferPool:
    """Spare drafter-cache buffers by (layer, capacity). A finished request's buffers serve
    the next request, so a request that grows its cache along the same capacities meets the
    same buffers, at the same addresses, that the captured draft graphs read: they replay
    instead of being captured again for every request (spec/draft_graphs.py). Unused slots
    need only pos = -1 (masked); stale K/V values there are never read unmasked."""

    def __init__(self, per_key: int = 2):
        self.per_key = per_key
        self.spare: dict[tuple[int, int], list[tuple]] = {}

    def take(self, key: tuple[int, int], make):
        bufs = self.spare.get(key)
        if bufs and bufs[-1][2].is_inference() and not torch.is_inference_mode_enabled():
            bufs.clear()  # made under inference_mode: not writable outside it
        if not bufs:
            return make()
        k, v, pos = bufs.pop()
        pos.fill_(-1)
        return k, v, pos

    def give(self, key: tuple[int, int], buffers: tuple) -> None:
        bufs = self.spare.setdefault(key, [])
        if len(bufs) < self.per_key and all(b.data_ptr() != buffers[0].data_ptr() for b, _, _ in bufs):
            bufs.append(buffers)


class DrafterCache:
    """One request's drafter state: committed-context K/V per layer, nothing else."""

    def __init__(self, layers: list[LayerKV]):
        self.layers = layers
        self.seq_len = 0  # committed positions appended so far

    def release(self) -> None:
        """The request is done: its buffers go back to the drafter's pool (if it has one)."""
        for layer in self.layers:
            layer.release()

    def num_cached(self) -> list[int]:
        return [layer.n for layer in self.layers]

    def reserve(self, t: int) -> list[int]:
        """Room for t more rows in every layer (a full layer grows now, on the host); each
        layer's first slot for them (see LayerKV.reserve)."""
        return [layer.reserve(t) for layer in self.layers]

    def advance(self, t: int) -> None:
        """The host's side of a static append of t rows, once the device has written them."""
        for layer in self.layers:
            layer.advance(t)
        self.seq_len += t


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
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
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary):
        """x [..., T, hidden] -> k, v [..., T, Hkv, D] (k normed and rotated)."""
        k = self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        return rotary.apply(k, cos, sin, norm=self.k_norm), v


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDrafter(nn.Module):
    """z-lab DFlash drafter; uses the target's embedding and lm_head weights ([V, hidden])."""

    # propose(static=True / full=True) and extend_static(count=...): fixed shapes, counts read on
    # the device (spec/draft_graphs.py; the overlapped step of spec/decoder.py)
    supports_static_propose = True

    def __init__(
        self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ):
        super().__init__()
        _check_heads(cfg, embed_weight, lm_head_weight)
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, interleave=False)
        # Shared with the target, not saved with the drafter.
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight, persistent=False)
        # Attention kernel: None = Triton on CUDA, torch otherwise; TREEFLASH_DRAFTER_ATTN=torch
        # or =triton pins it (A/B runs on a GPU).
        self.impl: str | None = os.environ.get("TREEFLASH_DRAFTER_ATTN") or None
        if self.impl not in (None, "torch", "triton"):
            raise ValueError(f"TREEFLASH_DRAFTER_ATTN must be 'torch' or 'triton', got {self.impl!r}")

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
    ) -> DFlashDrafter:
        """Build from z-lab tensor names (an optional `model.` prefix is accepted)."""
        dtype = dtype or embed_weight.dtype
        device = device or embed_weight.device
        model = cls(cfg, embed_weight.to(device, dtype), lm_head_weight.to(device, dtype))
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
    ) -> DFlashDrafter:
        """Load config.json + model.safetensors (or a sharded index) from a directory.

        With `target_cfg`, refuses a drafter that does not fit that target (ValueError).
        """
        cfg = DrafterConfig.from_hf(path)
        if target_cfg is not None:
            cfg.check_fits(target_cfg)
        return cls.from_state_dict(
            cfg, _read_safetensors(Path(path)), embed_weight, lm_head_weight, device, dtype
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
        self, cache: DrafterCache, features: torch.Tensor, positions: torch.Tensor | None = None
    ) -> None:
        """Append committed rows: features [T, n_taps*hidden] at positions [T].

        positions default to cache.seq_len + arange(T); they must continue the cache's
        run (not checked on device, to avoid a host sync).
        """
        t = features.shape[0]
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
                      first: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """extend() with device-side slots: features [T, taps*hidden] at positions start + 0..T-1
        (start [1]), layer i's rows into slots first[i] + 0..T-1. No host value enters the
        computation, so it can be captured; the caller reserves before and advances after.

        count [1] (device): append only the first count rows (LayerKV.write_at), so a step
        can queue its append before the host has learned how many drafts were accepted
        (the overlapped step, spec/decoder.py): T is then the block size, whatever count is."""
        t = features.shape[0]
        positions = start + torch.arange(t, device=features.device)
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, cache.layers, strict=True)):
            k, v = layer.self_attn.kv(ctx, cos, sin, self.rotary)
            kv.write_at(first[i], k.transpose(0, 1), v.transpose(0, 1), positions,
                        None if count is None else count[0])

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
        the host has not learned yet (the overlapped step, spec/decoder.py).
        """
        if static and len(caches) != 1:
            raise ValueError("a static proposal is for one request")
        bs = block_size or self.cfg.block_size
        if not 2 <= bs:
            raise ValueError(f"block_size must be >= 2, got {bs}")
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

    def _attend(self, i: int, h, ctx_k, ctx_v, ctx_pos, q_pos, cos, sin) -> torch.Tensor:
        """Layer i's attention of the block h [B, Q, hidden] over the context K/V [B, Hkv, L, D]
        (slot positions ctx_pos [B, L], -1 = padding) and the block itself (q_pos [B, Q])."""
        attn = self.layers[i].self_attn
        q = attn.q_proj(h).unflatten(-1, (attn.n_heads, attn.head_dim))
        q = self.rotary.apply(q, cos, sin, norm=attn.q_norm).transpose(1, 2)  # [B, Hq, Q, D]
        k, v = attn.kv(h, cos, sin, self.rotary)  # [B, Q, Hkv, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Q, D]
        scale = attn.head_dim**-0.5
        impl = self.impl or ("triton" if q.is_cuda else "torch")
        if impl == "torch":  # the mask through _block_mask: test drafters override it
            o = drafter_sdpa(q, ctx_k, ctx_v, k, v, self._block_mask(i, q_pos, ctx_pos), scale)
        else:  # reads the context once, in place (kernels/drafter_attn.py)
            o = kernels.drafter_attention(q, ctx_k, ctx_v, k, v, ctx_pos, q_pos, self.cfg.is_causal_layer(i),
                                          self.cfg.window(i), scale, impl=impl)
        return attn.o_proj(o.transpose(1, 2).flatten(2))  # [B, Q, hidden]

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
    one padded tensor (a paged drafter cache shared by the batch would avoid that: issue 7).
    """
    views = [c.layers[layer].full_view() if full else c.layers[layer].view() for c in caches]
    if len(views) == 1:
        kb, vb, pb = views[0]
        return kb.unsqueeze(0).to(dtype), vb.unsqueeze(0).to(dtype), pb.unsqueeze(0)
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
