"""Multi-head Latent Attention with the weight-absorbed path over a paged latent cache.

The cache holds one row of `kv_lora_rank + qk_rope_head_dim` values per token and layer:
the normalised compressed KV `c_kv` followed by the rotated shared key `k_pe`, in the model's
dtype or as fp8_e4m3 rows (`kvcache.format`, a uint8 cache: the kernels quantise on write and
decode inside the verify kernel; the queries stay in the model's dtype). Queries are
absorbed into that latent space (q_nope @ W_UK), attention runs there, and the output is
expanded by W_UV afterwards, so prefill, decode and tree verify are all one kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from treeflash import kernels
from treeflash.config import ModelConfig
from treeflash.models import dcp
from treeflash.models.layers import RMSNorm, Rotary, fused
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sharding import Parallel

# The latent norms (q_a_layernorm, kv_a_layernorm) use this epsilon whatever config.json's
# rms_norm_eps says, as the reference does: transformers' DeepseekV3Attention builds them with
# DeepseekV3RMSNorm's default (1e-6) and passes rms_norm_eps only to the layer norms. Kimi K2.6's
# config says 1e-5 (vLLM and SGLang pass the config's value to these two norms as well).
LATENT_NORM_EPS = 1e-6

# q_pe's rotation rides in the absorb launch (`kernels.head_matmul(rope=)`) up to this many rows a
# call: decode and verify trees; wider calls (prefill, 64-node chains) keep the rope launch
ROPE_IN_ABSORB_ROWS = 32


@dataclass
class AttnBatch:
    """Where B requests' N new rows live in the paged cache, and what they may see.

    page_table [B, max_pages] int32; prefix_lens [B] int32 = committed tokens before the
    new rows (the rows go to positions prefix_lens .. prefix_lens+N-1); tree_mask
    [B, N, N] bool (ancestor-or-self) or None for a causal chain; impl picks the kernel
    implementation (None: Triton on CUDA, torch otherwise). Under decode context parallelism
    (`models/dcp.py`): deal_unit = the pool's page size (positions dealt at a time), and
    commit_later = a verify, whose rows stay scratch until the commit (else they settle at once).
    """

    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor | None = None
    impl: str | None = None
    deal_unit: int = 0
    commit_later: bool = False
    # DCP's per-forward tensors, the same in every layer: built by the first layer, reused by the rest
    dcp_cache: dict = field(default_factory=dict, repr=False, compare=False)


class MLA(nn.Module):
    """Under tensor parallelism a rank holds `num_heads` = H/tp heads of q, kv_b and o_proj
    (o_proj's input columns); the latent projections and the latent cache are whole on
    every rank. The caller all-reduces the output (rank 0 alone holds o_proj's bias).
    q_a_layernorm / kv_a_layernorm use eps 1e-6 (`LATENT_NORM_EPS`), as transformers'
    DeepseekV3 does, not config.json's rms_norm_eps (Kimi K2.6: 1e-5)."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel | None = None, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.options = options
        self.parallel = parallel or Parallel()
        self.num_heads = self.parallel.local_heads(cfg)
        h, hidden = self.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, options)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, options)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, hidden, bias=cfg.attention_bias)
        # kv_a_proj_with_mqa and q_a_proj as one GEMM (fuse_a_projections): their weights (and
        # biases) as views of these, the Parameters that must still be in place for it to apply
        self._a_weight: torch.Tensor | None = None
        self._a_bias: torch.Tensor | None = None
        self._a_params: tuple = ()

    def fuse_a_projections(self) -> bool:
        """Store kv_a_proj_with_mqa's and q_a_proj's weights (both read x) as one
        [D + q_lora_rank, hidden] tensor, their Parameters becoming views of it (the state dict
        and the memory are unchanged), so that inference runs one GEMM where it ran two: one
        launch (and split-K reduce) fewer a layer. Off with `options.fused_a` off or without q_lora.
        Call after the weights are loaded; replacing either Parameter later turns it off."""
        if self.cfg.q_lora_rank is None or not self.options.fused_a:
            return False
        kv, q = self.kv_a_proj_with_mqa, self.q_a_proj
        d = kv.weight.shape[0]
        with torch.no_grad():
            w = torch.cat([kv.weight, q.weight])
            b = torch.cat([kv.bias, q.bias]) if kv.bias is not None else None
        kv.weight = nn.Parameter(w[:d], requires_grad=kv.weight.requires_grad)
        q.weight = nn.Parameter(w[d:], requires_grad=q.weight.requires_grad)
        if b is not None:
            kv.bias = nn.Parameter(b[:d], requires_grad=kv.bias.requires_grad)
            q.bias = nn.Parameter(b[d:], requires_grad=q.bias.requires_grad)
        self._a_weight, self._a_bias = w, b
        self._a_params = (kv.weight, q.weight, kv.bias, q.bias)
        return True

    def _a_fused(self) -> bool:
        if self._a_weight is None:
            return False
        kv, q = self.kv_a_proj_with_mqa, self.q_a_proj
        return (all(a is b for a, b in zip(self._a_params, (kv.weight, q.weight, kv.bias, q.bias)))
                and not (torch.is_grad_enabled() and (kv.weight.requires_grad or q.weight.requires_grad)))

    def _a_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(latents [B, N, D] = c_kv | k_pe, q_a_proj(x) or None without q_lora), before norm /
        rope: one GEMM where the a-projections are fused."""
        if self._a_fused():
            d = self.kv_a_proj_with_mqa.weight.shape[0]
            latents, qa = F.linear(x, self._a_weight, self._a_bias).split([d, self.cfg.q_lora_rank], dim=-1)
            return latents, qa
        kv, q = self.kv_a_proj_with_mqa, getattr(self, "q_a_proj", None)
        return F.linear(x, kv.weight, kv.bias), None if q is None else F.linear(x, q.weight, q.bias)

    def _prep_in_one_launch(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether `kernels.mla_latent_prep` can take the norms, k_pe's rotation and the cache
        store (`options.mla_prep` off keeps them as separate launches): per-row tables and norm
        weights of x's dtype (a promoting norm takes the torch ops)."""
        if not self.options.mla_prep or tuple(cos.shape[:-1]) != tuple(x.shape[:-1]):
            return False
        norms = [self.kv_a_layernorm] + ([] if self.cfg.q_lora_rank is None else [self.q_a_layernorm])
        return all(m.weight.dtype == x.dtype for m in norms)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [B, N, rope/2]
        rotary: Rotary,
        kv_cache: torch.Tensor,  # [num_pages, page_size, D], this layer's latent cache
        batch: AttnBatch,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, n, _ = x.shape
        h, r, nope = self.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        shared = batch
        if self.parallel.dcp_size > 1:  # the new rows go after this rank's share (scratch rows)
            batch = dcp_local(batch, self.parallel)
        cos, sin = cos_sin
        # the queries' dtype: the cache's values (an fp8_e4m3 cache holds uint8 rows of x's dtype)
        q_dtype = x.dtype if kv_cache.dtype == torch.uint8 else kv_cache.dtype
        latents, qa = self._a_outputs(x)  # latents [B, N, D] = c_kv | k_pe
        impl = fused(self.options, x, self.kv_a_layernorm.weight)
        prep = impl is not None and self._prep_in_one_launch(x, cos)
        if prep:  # c_kv's norm, k_pe's rotation, the cache store and q_a's norm: one launch
            qa = kernels.mla_latent_prep(
                latents, kv_cache, batch.page_table, batch.prefix_lens, self.kv_a_layernorm.weight,
                self.kv_a_layernorm.eps, cos, sin, rotary.interleave, qa=qa,
                q_weight=None if qa is None else self.q_a_layernorm.weight,
                q_eps=1e-6 if qa is None else self.q_a_layernorm.eps, impl=impl,
            )
        elif qa is not None:
            qa = self.q_a_layernorm(qa)
        q = (F.linear(x, self.q_proj.weight) if qa is None else F.linear(qa, self.q_b_proj.weight))
        q = q.view(b, n, h, cfg.qk_head_dim)
        q_nope, q_pe = q.split([nope, cfg.qk_rope_head_dim], dim=-1)
        w = self.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, r], [H, v, r]
        # absorb / expand as one launch each (`options.head_matmul` off: the einsums and their copies)
        heads = impl if self.options.head_matmul else None
        if impl is not None:
            q_abs = self._queries_fused(x, latents, q_nope, q_pe, w_uk, cos, sin, rotary, prep, impl, heads, q_dtype)
        else:
            latents, q_abs = self._queries_torch(latents, q_nope, q_pe, w_uk, cos, sin, rotary, q_dtype)
        if not prep:
            kernels.kv_write(kv_cache, batch.page_table, batch.prefix_lens, latents, impl=batch.impl, v_dim=r)
        if self.parallel.dcp_size > 1:
            out_lat = self._attend_dcp(q_abs, kv_cache, batch, shared)
        else:
            out_lat, _ = kernels.mla_verify_attention(
                q_abs, kv_cache, batch.page_table, batch.prefix_lens, batch.tree_mask,
                cfg.softmax_scale, v_dim=r, impl=batch.impl,
            )  # [B, N, H, r]
        if heads is not None and out_lat.dtype == x.dtype:  # one launch, stored as o_proj reads it
            out = kernels.head_matmul(out_lat.reshape(b * n, h, r), w_uv.transpose(1, 2), impl=impl)
        else:
            out = torch.einsum("bnhr,hvr->bnhv", out_lat.to(x.dtype), w_uv)  # [B, N, H, v]
        return F.linear(out.reshape(b, n, h * cfg.v_head_dim), self.o_proj.weight, self.o_proj.bias)

    def _queries_fused(self, x, latents, q_nope, q_pe, w_uk, cos, sin, rotary: Rotary, prep: bool, impl,
                       heads, q_dtype) -> torch.Tensor:
        """q_abs [B, N, H, r + rope] by the fused launches (and latents normalised / rotated in
        place unless the prep launch did it)."""
        b, n, h = q_nope.shape[0], q_nope.shape[1], self.num_heads
        r, nope = self.cfg.kv_lora_rank, self.cfg.qk_nope_head_dim
        # Normalise c_kv and rotate k_pe in place (unless prep stored them already), rotate
        # q_pe into its slot of q_abs, absorb q_nope into the rest: four launches where the
        # torch ops below take ~25. In 16-bit at up to ROPE_IN_ABSORB_ROWS rows the rotation
        # runs inside the absorb launch (the same bits as the rope launch; H100, 2026-12-06,
        # results/h100-20261206-rope-in-absorb-sweep: -1.3 us a layer at 8 heads, -6.3 at 128,
        # but +0.5 at 8 heads x 64 rows); `options.rope_in_absorb` off: never
        if not prep:
            self.kv_a_layernorm(latents[..., :r], out=latents[..., :r])
            rotary.apply(latents[..., r:], cos, sin, out=latents[..., r:])
        q_abs = torch.empty(b, n, h, r + self.cfg.qk_rope_head_dim, dtype=q_dtype, device=x.device)
        m = b * n
        rope = None
        if (heads is not None and q_abs.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
                and cos.dtype == x.dtype and tuple(cos.shape[:-1]) == (b, n)
                and self.options.rope_in_absorb and m <= ROPE_IN_ABSORB_ROWS):
            rope = (q_pe.reshape(m, h, -1), cos.reshape(m, -1), sin.reshape(m, -1), rotary.interleave,
                    q_abs.view(m, h, -1)[..., r:])
        elif q_abs.dtype == x.dtype:
            rotary.apply(q_pe, cos, sin, out=q_abs[..., r:])
        else:
            q_abs[..., r:] = rotary.apply(q_pe, cos, sin)
        if heads is not None and q_abs.dtype == x.dtype:
            kernels.head_matmul(q_nope.reshape(m, h, nope), w_uk, out=q_abs.view(m, h, -1)[..., :r],
                                impl=impl, rope=rope)
        else:
            q_abs[..., :r] = torch.einsum("bnhd,hdr->bnhr", q_nope, w_uk)
        return q_abs

    def _queries_torch(self, latents, q_nope, q_pe, w_uk, cos, sin, rotary: Rotary, q_dtype):
        """The reference: latents normalised / rotated (a new tensor) and q_abs, by torch ops."""
        r = self.cfg.kv_lora_rank
        c_kv, k_pe = latents.split([r, self.cfg.qk_rope_head_dim], dim=-1)
        latents = torch.cat([self.kv_a_layernorm(c_kv), rotary.apply(k_pe, cos, sin)], dim=-1)
        q_lat = torch.einsum("bnhd,hdr->bnhr", q_nope, w_uk)  # [B, N, H, r]
        q_abs = torch.cat([q_lat, rotary.apply(q_pe, cos, sin)], dim=-1).to(q_dtype)
        return latents, q_abs

    def _attend_dcp(self, q_abs: torch.Tensor, kv_cache: torch.Tensor, local: AttnBatch,
                    shared: AttnBatch) -> torch.Tensor:
        """Attention under decode context parallelism (`models/dcp.py`): the group's heads over
        this rank's share (the new rows seen on group rank 0 only), one all-to-all of the
        partials, their LSE merge; then the rows that stay settle. Returns [B, N, H, r]."""
        par, cfg = self.parallel, self.cfg
        b, n = q_abs.shape[:2]
        q_all = dcp.gather_heads(q_abs, par.dcp_size, par.dcp_group)  # [B, N, dcp*H, D]
        mask = local.tree_mask
        if par.dcp_rank != 0:  # the new rows are group rank 0's to see
            mask = shared.dcp_cache.get("mask")
            if mask is None:
                mask = shared.dcp_cache["mask"] = torch.zeros(b, n, n, dtype=torch.bool, device=q_abs.device)
        out, lse = kernels.mla_verify_attention(
            q_all, kv_cache, local.page_table, local.prefix_lens, mask, cfg.softmax_scale,
            v_dim=cfg.kv_lora_rank, impl=local.impl,
        )
        parts = dcp.exchange_partials(out, lse, par.dcp_size, par.dcp_group)  # [dcp, B, N, H, r + k]
        merged, _ = dcp.merge(parts, cfg.kv_lora_rank, local.impl)
        # one row a request (plain decode) sits on its owner at the owner's local prefix, its final
        # local row: the settle would move it onto itself (`models/dcp.py`)
        if not shared.commit_later and n > 1:
            plan = shared.dcp_cache.get("settle")
            if plan is None:
                plan = shared.dcp_cache["settle"] = dcp.settle_plan(shared.prefix_lens, n, par.dcp_rank, par.dcp_size,
                                                                    shared.deal_unit)
            kernels.kv_commit(kv_cache, local.page_table, *plan, impl=local.impl)
        return merged


def dcp_local(batch: AttnBatch, par: Parallel) -> AttnBatch:
    """`batch` as this DCP rank's kernels read it: prefix_lens = the rank's share of the prefix."""
    local = batch.dcp_cache.get("local")
    if local is None:
        if batch.deal_unit < 1:
            raise ValueError("decode context parallelism needs AttnBatch.deal_unit (the pool's page size)")
        lens = dcp.local_lens(batch.prefix_lens, par.dcp_rank, par.dcp_size, batch.deal_unit)
        local = batch.dcp_cache["local"] = replace(batch, prefix_lens=lens.to(torch.int32).contiguous(),
                                                   dcp_cache={})
    return local
