"""Public kernel functions. Models call only these; each has a torch twin in `reference.py`.

`impl=None` picks Triton for CUDA tensors and the torch reference otherwise;
`impl="triton"` on CPU tensors runs under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from treeflash.kernels import reference
from treeflash.kernels.int4 import Int4Weight


def _pick(impl: str | None, t: torch.Tensor) -> str:
    if impl is None:
        return "triton" if t.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton', 'torch' or None, got {impl!r}")
    return impl


def mla_verify_attention(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim=512, impl=None):
    """Absorbed-MLA attention of N new rows per request over its paged latent cache.

    q [B, N, H, D] (bf16/fp16/fp32); kv_cache [num_pages, page_size, D] (row = c_kv then
    k_pe; values are the first v_dim entries) in q's dtype, or fp8_e4m3 rows [num_pages,
    page_size, row_bytes] uint8 (`kvcache.format`: c_kv = the first v_dim values in e4m3 with
    per-128 scales, decoded inside the kernel); page_table [B, max_pages] int32;
    prefix_lens [B] int32. The N rows' own latents are already stored at positions
    prefix_lens[b] .. prefix_lens[b]+N-1. tree_mask [B, N, N] bool (node j is i or an
    ancestor of i) or None for a causal chain. Every row sees the whole prefix.
    Returns out [B, N, H, v_dim] (dtype of q) and lse [B, N, H] float32 (natural log).
    """
    if _pick(impl, q) == "torch":
        return reference.mla_verify_attention(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim)
    from treeflash.kernels.mla_verify import mla_verify_attention_triton

    return mla_verify_attention_triton(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim)


def kv_write(kv_cache, page_table, start_lens, latents, impl=None, v_dim=None):
    """Store latents [B, N, D] at positions start_lens[b] .. +N-1 of each request (in place).
    An fp8_e4m3 cache ([pages, page_size, row_bytes] uint8, `kvcache.format`) stores them
    quantised, the first v_dim (kv_lora_rank) columns in e4m3 with per-128 scales."""
    if _pick(impl, latents) == "torch":
        return reference.kv_write(kv_cache, page_table, start_lens, latents, v_dim=v_dim)
    from treeflash.kernels.kv_ops import kv_write_triton

    return kv_write_triton(kv_cache, page_table, start_lens, latents, v_dim)


def mla_latent_prep(latents, kv_cache, page_table, start_lens, kv_weight, kv_eps, cos, sin, interleave,
                    qa=None, q_weight=None, q_eps=1e-6, qa_out=None, impl=None):
    """One MLA layer's work between its a-projection and q_b. latents [B, N, D] = c_kv | k_pe:
    c_kv RMS-normalised by kv_weight (kv_a_layernorm; the latents' dtype), k_pe rotated by cos /
    sin [B, N, rope/2] (interleaved pairs de-interleaved, as `rope`), and the row stored at
    position start_lens[b] + i of request b in kv_cache [pages, page_size, D] (`kv_write`'s
    addressing, cast to the cache dtype). qa [B, N, q_lora] (optional, q_a_proj's output):
    RMS-normalised by q_weight into qa_out (new if None), which is returned (else None). The
    latents are not modified. One launch on the Triton path (`kernels/mla_prep.py`)."""
    if _pick(impl, latents) == "torch":
        return reference.mla_latent_prep(latents, kv_cache, page_table, start_lens, kv_weight, kv_eps, cos, sin,
                                         interleave, qa, q_weight, q_eps, qa_out)
    from treeflash.kernels.mla_prep import mla_latent_prep_triton

    return mla_latent_prep_triton(latents, kv_cache, page_table, start_lens, kv_weight, kv_eps, cos, sin,
                                  interleave, qa, q_weight, q_eps, qa_out)


def kv_commit(kv_cache, page_table, prefix_lens, accept_idx, num_accepted, impl=None):
    """After verify: move row prefix+accept_idx[b, j] to prefix+j for j < num_accepted[b].

    kv_cache [..., num_pages, page_size, D] (leading dims = layers, all moved at once);
    accept_idx [B, M] int (node indices, increasing, accept_idx[b, 0] = 0); in place.
    """
    if _pick(impl, accept_idx) == "torch":
        return reference.kv_commit(kv_cache, page_table, prefix_lens, accept_idx, num_accepted)
    from treeflash.kernels.kv_ops import kv_commit_triton

    return kv_commit_triton(kv_cache, page_table, prefix_lens, accept_idx, num_accepted)


def rms_norm(x, weight, eps, residual=None, out=None, residual_out=None, impl=None):
    """RMSNorm of x's last dim: weight * (x / rms(x)) with the mean square in float32 and the
    normalised row rounded to x.dtype before the weight. residual: normalise x + residual
    instead and return (normed, x + residual). out / residual_out (may alias x) receive the
    results; rows of x must flatten without a copy. One launch on the Triton path
    (`kernels/norm_rope.py`)."""
    if _pick(impl, x) == "torch":
        return reference.rms_norm(x, weight, eps, residual, out, residual_out)
    from treeflash.kernels.norm_rope import rms_norm_triton

    return rms_norm_triton(x, weight, eps, residual, out, residual_out)


def rope(x, cos, sin, interleave, out=None, norm_weight=None, eps=1e-6, impl=None):
    """Rotary embedding of x [..., T, (heads,) dim] by cos/sin [..., T, dim/2] (x's dtype);
    interleaved pairs come out de-interleaved (evens then odds). norm_weight: a per-row
    RMSNorm over dim first (Qwen3's q_norm / k_norm), in the same launch. out may alias x."""
    if _pick(impl, x) == "torch":
        return reference.rope(x, cos, sin, interleave, out, norm_weight, eps)
    from treeflash.kernels.norm_rope import rope_triton

    return rope_triton(x, cos, sin, interleave, out, norm_weight, eps)



def rope_tables(positions, inv_freq, scale, dtype):
    """cos, sin [..., D/2] in dtype for integer positions [...]: `Rotary.cos_sin`'s arithmetic
    (positions cast to float32 times inv_freq, upcast to float32 if it is a half buffer; cos and
    sin in float32, times scale unless it is 1; rounded to dtype). The torch side of
    `qk_norm_rope`."""
    freqs = positions[..., None].float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps_q, eps_k, interleave, scale=1.0,
                 out_q=None, out_k=None, impl=None):
    """The DFlash drafter's q and k after their projection, one launch on the Triton path: each
    head RMSNorm-ed over D (q_weight / k_weight [D], x's dtype; both None: no norm), then rotated
    by the positions' cos/sin, which the kernel computes itself as `rope_tables` does.

    q [..., T, Hq, D], k [..., T, Hk, D] (one dtype, unit stride in D, any other strides: e.g.
    column slices of one qkv GEMM's output); positions [..., T] integers; inv_freq [D/2] (any
    float dtype: upcast to float32 before the product). Returns (q', k'); out_q / out_k (may
    alias q / k) receive them. Equals `rope(rms_norm(q), *rope_tables(...))` (and k's) up to
    the kernels' own rounding notes (`kernels/norm_rope.py`)."""
    if _pick(impl, q) == "torch":
        cos, sin = rope_tables(positions, inv_freq, scale, q.dtype)
        return (reference.rope(q, cos, sin, interleave, out_q, q_weight, eps_q),
                reference.rope(k, cos, sin, interleave, out_k, k_weight, eps_k))
    from treeflash.kernels.norm_rope import qk_norm_rope_triton

    return qk_norm_rope_triton(q, k, positions, inv_freq, q_weight, k_weight, eps_q, eps_k, interleave,
                               scale, out_q, out_k)


def silu_mul(gate, up, out=None, impl=None):
    """SwiGLU's silu(gate) * up as torch computes `F.silu(gate) * up` (the silu rounded to the
    dtype, then the product rounded); gate / up [..., N] of one dtype, unit stride in N, rows
    that flatten (e.g. the two halves of one gate_up GEMM's output). One launch on the Triton
    path (`kernels/norm_rope.py`)."""
    if _pick(impl, gate) == "torch":
        y = torch.nn.functional.silu(gate) * up
        if out is not None:
            out.copy_(y)
            y = out
        return y
    from treeflash.kernels.norm_rope import silu_mul_triton

    return silu_mul_triton(gate, up, out)

def head_matmul(a, b, out=None, impl=None, rope=None):
    """out[m, h, n] = sum_k a[m, h, k] * b[h, k, n] (MLA's absorb / expand): a [M, H, K] and b
    [H, K, N] of one float dtype, any strides; out [M, H, N] (any strides, e.g. a slice of q_abs;
    None: a new contiguous tensor) receives the float32 sums in its dtype. The torch path is the
    einsum (+ a copy into out); the Triton path (`kernels/mla_heads.py`, not head_matmul.py: that
    import would replace this function) is one launch that stores into out's strides.
    rope: (x [M, H, R], cos [M, R/2], sin, interleave, xo [M, H, R]): also `rope(x, cos, sin,
    interleave, out=xo)` (MLA's q_pe into q_abs), in the same launch on the Triton path, which
    takes them in one 16-bit dtype only (float32 would need FP contraction off for the dot too)."""
    if _pick(impl, a) == "torch":
        y = torch.einsum("mhk,hkn->mhn", a, b)
        if out is not None:
            out.copy_(y)
            y = out
        if rope is not None:
            reference.rope(*rope[:4], out=rope[4])
        return y
    from treeflash.kernels.mla_heads import head_matmul_triton

    return head_matmul_triton(a, b, out, rope)


def drafter_kv_write(kv, start, first, count, layers, inv_freq, scale, interleave, eps, impl=None):
    """The drafter's cache append of T rows (`DFlashDrafter.extend_static`), after one GEMM.

    kv [T, L*2*Hkv*D]: row t's k and v of every layer (layer l's k heads at columns
    l*2*Hkv*D.., its v heads after them), or [L, T, 2*Hkv*D] (a batched GEMM's output, any
    layer / row strides, unit column stride), at position start + t (start [1] long, device).
    layers: per layer (k, v [Hkv, capacity, D] contiguous, pos [capacity] long, k_norm weight
    [D], ring: sliding-window ring or full). first [L] long (device): each layer's first slot.
    k is RMS-normed over D (k_norm, eps) and rotated by cos/sin(position * inv_freq) (times
    scale if != 1, rounded to kv's dtype: `Rotary.cos_sin`); k, v and the position go to
    `LayerKV.write_at`'s slots (count [1] long or None: its masked append); capacity-0 layers
    are skipped. In place, no host read of a device value. One launch on the Triton path
    (`kernels/drafter_kv.py`, up to 4 layers a launch).
    """
    from treeflash.kernels import drafter_kv

    args = (kv, start, first, count, layers, inv_freq, scale, interleave, eps)
    if _pick(impl, kv) == "torch":
        return drafter_kv.drafter_kv_write_torch(*args)
    return drafter_kv.drafter_kv_write_triton(*args)


def moe_experts(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0, num_experts=None,
                impl=None, shared=None, stats=None, tiles=None, split_k=None, int4_copy=None):
    """Routed experts of a MoE layer: out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t]), no host sync.

    x [T, hidden]; topk_weights [T, K] float; topk_ids [T, K] int global expert ids;
    w_gate, w_up [E, inter, hidden], w_down [E, hidden, inter] (tensors in x.dtype, or
    `kernels.int4.Int4Weight` stacks of those logical shapes: W4A16): this rank's experts
    expert_offset .. expert_offset+E-1 (pairs routed elsewhere contribute 0); num_experts:
    the router's width (None: E). MLP = down(silu(gate x) * up x). Returns [T, hidden]
    in x.dtype. The Triton path (`kernels/moe_gemm.py`; `kernels/moe_w4a16.py` for INT4 stacks,
    unpacked in registers) sorts pairs by expert and reads each touched expert's weights once per
    BLOCK_M rows; the torch path is exact (INT4 experts dequantized one touched expert at a time).
    shared: the shared experts' (gate [Si, hidden], up [Si, hidden], down [hidden, Si]) weights,
    added to every token; the Triton path runs them as Si / inter more experts of weight 1 in
    the same launches (Si must be a multiple of inter: `moe_gemm.shared_chunks`).
    stats: (last, total) [num_experts] int64 routing statistics, as `expert_counts` fills them
    (the Triton path's routing launch fills them itself where every expert is local).
    tiles / split_k: the Triton call's tiles (integers, in the format of `moe_gemm` or, for INT4
    stacks, `moe_w4a16.Tiles`) and gate_up split count; None: planned per call (tuning runs).
    int4_copy: INT4 stacks' copy in humming-kernels' layout (`moe_w4a16.humming.HummingExperts`), which
    the W4A16 dispatch runs at the rows it was measured faster at.
    """
    if _pick(impl, x) == "torch":
        if stats is not None:
            expert_counts(topk_ids, *stats, impl="torch")
        return reference.moe_experts(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset,
                                     num_experts, shared=shared)
    int4 = [isinstance(w, Int4Weight) for w in (w_gate, w_up, w_down)]
    if any(int4):
        if not all(int4):
            raise TypeError("w_gate, w_up and w_down must all be Int4Weight stacks or all tensors, got "
                            + ", ".join(type(w).__name__ for w in (w_gate, w_up, w_down)))
        from treeflash.kernels.moe_w4a16 import Tiles, moe_experts_w4a16

        return moe_experts_w4a16(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset, num_experts,
                                 shared=shared, stats=stats, split_k=split_k,
                                 tiles=None if tiles is None else Tiles.parse(tiles), humming=int4_copy)
    from treeflash.kernels.moe_gemm import moe_experts_triton

    return moe_experts_triton(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset, num_experts,
                              shared=shared, stats=stats, split_k=split_k, tiles=tiles)


def drafter_attention(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale, impl=None):
    """DFlash drafter attention: block rows q [B, Hq, Q, D] against the context K/V [B, Hkv, L, D]
    (slot positions ctx_pos [B, L], -1 = padding, never read) and the block's own K/V
    [B, Hkv, Q, D] (positions q_pos [B, Q]); GQA head h uses kv head h // (Hq / Hkv); causal
    cuts block keys after the row, a window W (int or None) cuts |p - j| >= W. Returns
    [B, Hq, Q, D] in q.dtype. The Triton path (`kernels/drafter_attn.py`) reads the context
    once, in place; the torch path concatenates and repeats it (the drafter's SDPA path).
    """
    if _pick(impl, q) == "torch":
        return reference.drafter_attention(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale)
    from treeflash.kernels.drafter_attn import drafter_attention_triton

    return drafter_attention_triton(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale)


def moe_gate(logits, bias, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob,
             routed_scaling_factor, impl=None):
    """MoE routing from the router logits: (weights [T, top_k] float32, ids [T, top_k] int64).

    logits [T, E] float32; bias [E] (e_score_correction_bias, added for the choice only when
    topk_method == "noaux_tc"). scores = sigmoid or softmax(logits); unless greedy, only the
    topk_group best of n_group groups (top-2 sum for noaux_tc, best expert otherwise) stay
    eligible; ids = top_k of the choice; weights = scores[ids], renormalised to sum 1 if
    norm_topk_prob, times routed_scaling_factor. The rows' id order is unspecified. The Triton
    path (`kernels/moe_router.py`) is one launch for E <= 512 and top_k <= 16 (impl=None goes to
    torch beyond); the torch path is the model's original routing, op for op.
    """
    args = (logits, bias, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob,
            routed_scaling_factor)
    if _pick(impl, logits) == "torch":
        return reference.moe_gate(*args)
    # (kernels/moe_router.py: a submodule named moe_gate would shadow this function on import)
    from treeflash.kernels.moe_router import MAX_EXPERTS, MAX_TOPK, moe_gate_triton

    if impl is None and (logits.shape[-1] > MAX_EXPERTS or top_k > MAX_TOPK):
        return reference.moe_gate(*args)
    return moe_gate_triton(*args)


def moe_gate_fused(x, weight, bias, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob,
                   routed_scaling_factor, impl=None):
    """`moe_gate(F.linear(x.float(), weight.float()), bias, ...)` with the logits GEMM folded in.

    x [T, hidden] (any float dtype); weight [E, hidden]. The Triton path (`kernels/moe_router.py`)
    is one launch computing each row's logits in float32 in its own sum order (last-bit
    differences from cuBLAS):
    - small routers (`moe_router.fused_logits_ok`: E * hidden <= 32768): one program a row
      (FUSED_LOGITS; float32 weight taken as is, others cast);
    - larger ones at decode / verify sizes (`split_logits_ok`: up to 4 rows, or 64 with x and the
      weight in the same 16-bit dtype): the split launch, the weight read in its own dtype across
      the SMs, a program a row routing after;
    - beyond, impl=None goes to the GEMM + `moe_gate` (impl="triton" to the one-program-a-row kernel).
    The torch path is F.linear then the twin, op for op.
    """
    args = (bias, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    if _pick(impl, x) == "triton":
        from treeflash.kernels.moe_router import (
            fused_logits_ok,
            moe_gate_fused_triton,
            moe_gate_split_triton,
            split_logits_ok,
        )

        if fused_logits_ok(weight.shape[0], weight.shape[1], top_k):
            return moe_gate_fused_triton(x, weight.float(), *args)
        if split_logits_ok(x.shape[0], weight.shape[0], top_k, x.dtype, weight.dtype):
            return moe_gate_split_triton(x, weight, *args)
        if impl is not None:
            return moe_gate_fused_triton(x, weight.float(), *args)
    return moe_gate(torch.nn.functional.linear(x.float(), weight.float()), *args, impl=impl)


def expert_counts(ids, last, total, impl=None):
    """Routing statistics of one forward, in place: last[:] = tokens per expert among ids (int,
    values in [0, E)), total += last; last / total [E] int64. The Triton path is one launch
    (`kernels/moe_router.py`) for up to COUNT_MAX_IDS ids (impl=None goes to torch beyond); the
    torch path is zero_, scatter_add_ of ones and an add."""
    if _pick(impl, ids) == "triton":
        from treeflash.kernels.moe_router import COUNT_MAX_IDS, expert_counts_triton

        if impl is not None or ids.numel() <= COUNT_MAX_IDS:
            expert_counts_triton(ids, last, total)
            return
    reference.expert_counts(ids, last, total)


def tree_walk(tokens, parents, depths, valid, ancestor_mask, post, width, candidates=None, impl=None):
    """The walk of a verified draft tree and the step's packed result, on the device.

    tokens / parents / depths [B, N] long, valid [B, N] bool, ancestor_mask [B, N, N] bool
    (a DraftTree's fields: parents before children, sibling tokens distinct); post [B, N]
    long, the target's token after every node; width = max depth + 1; candidates [C] long
    (auto-budget node bounds) or None. Returns (path, index, rows, num_accepted, depth, bonus,
    new_tokens, packed): path [B, W] the accepted node at each depth, root first, -1 pads;
    index = path clamped at 0; rows [B] = num_accepted + 1; num_accepted [B] accepted drafts;
    depth [B] the deepest accepted node's depth; bonus [B] the target's token after it;
    new_tokens [B, W] accepted drafts then the bonus, -1 pads; packed [B, W + 3 (+ C)] long =
    new_tokens | num_accepted | draft nodes | depth (| drafts accepted among nodes 1..c, per
    candidate c). One launch on the Triton path (`kernels/walk_pack.py`).
    """
    args = (tokens, parents, depths, valid, ancestor_mask, post, width, candidates)
    if _pick(impl, tokens) == "torch":
        return reference.tree_walk(*args)
    from treeflash.kernels.walk_pack import tree_walk_triton  # (a submodule named tree_walk would shadow this function)

    return tree_walk_triton(*args)


def argmax(x, impl=None):
    """Index of the first maximum along the last dim (torch.argmax(-1)'s result and tie rule) of
    finite x [..., V] (any float dtype; argmax of bf16 logits = argmax of their float32 copy).
    One program a row on the Triton path (`kernels/walk_pack.py`): torch's reduction over a few
    rows of a 4k-163k vocabulary runs ~16 us (H200, 32 x 4096, 2026-12-03 step profile)."""
    if _pick(impl, x) == "torch":
        return x.argmax(-1)
    from treeflash.kernels.walk_pack import argmax_rows_triton

    return argmax_rows_triton(x)


def topk_logprobs(logits, k, impl=None, fused: bool = True):
    """The k best tokens of each row of the drafter's logits [..., V] (any float dtype, computed in
    float32): (top_lp float32 [..., k], top_tok int64 [..., k]), top_lp = log_softmax(logits)
    at top_tok, descending. impl=None: on CUDA where `kernels/topk_lp.py` applies (V <= 16384,
    k <= 128; fused=False, the runtime option fused_topk=0, opts out) one Triton program a row; everywhere else torch's
    `log_softmax(x.float()).topk(k)` (its order among equal logits is its own). impl="triton" /
    "torch": the kernel / its twin `reference.topk_logprobs`, both with one fixed tie rule (logit
    descending, then the lower token id; chosen on the logit, so exp/log rounding cannot change
    the tokens). torch's log_softmax + topk over [1, 15, 4096] runs ~31 us on an H200."""
    if impl is None:
        kernel = logits.is_cuda and fused
        if kernel:
            from treeflash.kernels.topk_lp import supported

            kernel = supported(logits, k)
        if not kernel:
            return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        impl = "triton"
    if _pick(impl, logits) == "torch":
        return reference.topk_logprobs(logits, k)
    from treeflash.kernels.topk_lp import topk_logprobs_triton

    return topk_logprobs_triton(logits, k)
