"""Torch twins of every kernel: the executable specification.

Each function here has the same signature as its public counterpart in
`treeflash.kernels` and is what tests compare the Triton kernels against. Written for
clarity, not speed; computes in float32 (or the input's dtype if that is float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from treeflash.kernels.int4 import Int4Weight
from treeflash.kvcache.format import check_fp8_rows, dequantize_rows, is_fp8_rows, quantize_rows

# cuDNN's SDPA builds an execution plan for every new shape, ~16 ms of host time each on an
# H200 (torch 2.11, profile_spec_graphs.py 2026-12-02); the drafter's context length changes
# every step, so eager decoding paid it every step, and a plan built during a CUDA-graph
# capture broke the capture (a caching-allocator assert). The other backends have no plans.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _positions_to_slots(page_table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slot index (page * page_size + offset) of positions `pos` [B, K] of each request."""
    page = torch.gather(page_table.long(), 1, pos // page_size)  # [B, K]
    return page * page_size + pos % page_size


def gather_kv(kv_cache: torch.Tensor, page_table: torch.Tensor, lens: torch.Tensor, max_len: int,
              dim: int | None = None, v_dim: int | None = None, dtype: torch.dtype = torch.float32):
    """Rows 0..max_len-1 of every request as a dense [B, max_len, D] tensor (padding rows zeroed).
    fp8_e4m3 rows (uint8, `kvcache.format`) come decoded to `dtype` (dim, v_dim: their geometry)."""
    num_pages, page_size, d = kv_cache.shape
    b = page_table.shape[0]
    pos = torch.arange(max_len, device=kv_cache.device).expand(b, max_len)
    valid = pos < lens.long()[:, None]
    safe_pos = torch.where(valid, pos, torch.zeros_like(pos))
    slots = _positions_to_slots(page_table, safe_pos, page_size)
    rows = kv_cache.reshape(num_pages * page_size, d)[slots.clamp(0, num_pages * page_size - 1)]
    if is_fp8_rows(kv_cache):
        check_fp8_rows(kv_cache, dim, v_dim)
        rows = dequantize_rows(rows, dim, v_dim, dtype)
    return torch.where(valid[..., None], rows, torch.zeros_like(rows)), valid


def mla_verify_attention(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim=512, impl=None):
    """Reference for `treeflash.kernels.mla_verify_attention` (see its docstring)."""
    del impl
    b, n, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    total = prefix_lens.long() + n
    max_len = int(total.max().item())
    kv, valid = gather_kv(kv_cache, page_table, total, max_len, d, v_dim, acc)  # [B, S, D]
    kv = kv.to(acc)
    scores = torch.einsum("bnhd,bsd->bnhs", q.to(acc), kv) * sm_scale  # [B, N, H, S]
    s_idx = torch.arange(max_len, device=q.device)
    prefix = prefix_lens.long()[:, None]
    in_prefix = s_idx[None, :] < prefix  # [B, S]
    allowed = in_prefix[:, None, :].expand(b, n, max_len).clone()  # [B, N, S]
    node_j = s_idx[None, :] - prefix  # [B, S], node index of each tree row
    is_node = (node_j >= 0) & (node_j < n)
    node_i = torch.arange(n, device=q.device)
    if tree_mask is None:
        tree_part = node_j[:, None, :] <= node_i[None, :, None]
    else:
        jj = node_j.clamp(0, n - 1)[:, None, :].expand(b, n, max_len)
        tree_part = torch.gather(tree_mask.bool(), 2, jj)
    allowed |= is_node[:, None, :] & tree_part
    allowed &= valid[:, None, :]
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, N, H]
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("bnhs,bsv->bnhv", p, kv[..., :v_dim])
    return out.to(q.dtype), lse.to(torch.float32)


def kv_write(kv_cache, page_table, start_lens, latents, impl=None, v_dim=None):
    """Reference for `treeflash.kernels.kv_write` (fp8_e4m3 rows: `kvcache.format.quantize_rows`)."""
    del impl
    num_pages, page_size, d = kv_cache.shape[-3:]
    b, n, _ = latents.shape
    pos = start_lens.long()[:, None] + torch.arange(n, device=latents.device)[None, :]
    slots = _positions_to_slots(page_table, pos, page_size).reshape(-1)
    if is_fp8_rows(kv_cache):
        if v_dim is None:
            raise ValueError("an fp8_e4m3 cache needs v_dim (the quantised part of a row, kv_lora_rank)")
        check_fp8_rows(kv_cache, latents.shape[-1], v_dim)
        rows = quantize_rows(latents.reshape(b * n, -1), v_dim)
    else:
        rows = latents.reshape(b * n, d).to(kv_cache.dtype)
    kv_cache.view(-1, d)[slots] = rows


def kv_commit(kv_cache, page_table, prefix_lens, accept_idx, num_accepted, impl=None):
    """Reference for `treeflash.kernels.kv_commit`."""
    del impl
    page_size, d = kv_cache.shape[-2:]
    flat = kv_cache.reshape(-1, kv_cache.shape[-3] * page_size, d)  # [L, slots, D]
    b, m = accept_idx.shape
    j = torch.arange(m, device=accept_idx.device)[None, :].expand(b, m)
    keep = j < num_accepted.long()[:, None]
    src_pos = prefix_lens.long()[:, None] + accept_idx.long()
    dst_pos = prefix_lens.long()[:, None] + j
    # Rows past num_accepted may lie beyond the page table: point them at the prefix start.
    src_pos = torch.where(keep, src_pos, prefix_lens.long()[:, None])
    dst_pos = torch.where(keep, dst_pos, prefix_lens.long()[:, None])
    src = _positions_to_slots(page_table, src_pos, page_size)[keep]
    dst = _positions_to_slots(page_table, dst_pos, page_size)[keep]
    flat[:, dst] = flat[:, src].clone()


# Bytes of gathered expert weights one chunk of the per-pair path may hold (CPU memory bound).
_MOE_GATHER_BYTES = 64 << 20


def rms_norm(x, weight, eps, residual=None, out=None, residual_out=None):
    """weight * (x / rms(x)), the mean square in float32 and the normalised x rounded to
    x.dtype before the weight (Hugging Face's order). With `residual`: x + residual first
    (rounded to x.dtype), returning (normed, that sum). `out` / `residual_out` receive the
    results (they may alias x)."""
    if residual is not None:
        x = x + residual
        if residual_out is not None:
            residual_out.copy_(x)
            x = residual_out
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y if residual is None else (y, x)


def rope(x, cos, sin, interleave, out=None, norm_weight=None, eps=1e-6):
    """Rotate the last dim of x [..., T, (heads,) dim] by cos/sin [..., T, dim/2] (broadcast
    over a heads axis if present). Interleaved checkpoints rotate pairs (x0, x1), (x2, x3)...
    and the result is laid out de-interleaved (evens then odds), as the reference does.
    `norm_weight`: an RMSNorm over dim (weight of x's dtype) before the rotation."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if out is not None:
        out.copy_(y)
        y = out
    return y


def mla_latent_prep(latents, kv_cache, page_table, start_lens, kv_weight, kv_eps, cos, sin, interleave,
                    qa=None, q_weight=None, q_eps=1e-6, qa_out=None):
    """Reference for `treeflash.kernels.mla_latent_prep`: rms_norm, rope and kv_write composed."""
    r = kv_weight.shape[0]
    row = torch.cat([rms_norm(latents[..., :r], kv_weight, kv_eps), rope(latents[..., r:], cos, sin, interleave)], -1)
    kv_write(kv_cache, page_table, start_lens, row.to(latents.dtype), v_dim=r)
    return None if qa is None else rms_norm(qa, q_weight, q_eps, out=qa_out)


def moe_experts(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0, num_experts=None,
                impl=None, shared=None):
    """Reference for `treeflash.kernels.moe_experts`: exact, static shapes, no host sync.

    out[t] = sum_j [ids[t, j] is local] * weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])
    with e = ids[t, j] - expert_offset. Two equivalent evaluations, picked from shapes
    alone (host ints): few pairs per expert (decode, a tree) gathers each pair's expert
    weights (chunked to bound memory); many (prefill) runs every local expert over every
    token and keeps the routed ones (E / top_k times the flops, each weight read once).
    Computes in float32 (float64 stays float64); returns x.dtype. shared: the shared
    experts' (gate [Si, hidden], up [Si, hidden], down [hidden, Si]), added to every token
    before the cast.
    """
    del impl, num_experts
    t, hid = x.shape
    e, inter, _ = w_gate.shape
    k = topk_ids.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    local = topk_ids.long() - expert_offset
    owned = (local >= 0) & (local < e)  # [T, K]
    weight = torch.where(owned, topk_weights.to(acc), torch.zeros((), dtype=acc, device=x.device))
    xf = x.to(acc)
    if t * k <= e:
        y = _moe_per_pair(xf, local.clamp(0, e - 1), w_gate, w_up, w_down, acc)  # [T, K, hidden]
    else:
        y = _moe_dense(xf, local, w_gate, w_up, w_down, acc)
    # Unrouted or unowned pairs contribute exactly nothing (where, not a multiply by 0).
    y = torch.where(owned[..., None], y * weight[..., None], torch.zeros((), dtype=acc, device=x.device))
    out = y.sum(1)
    if shared is not None:
        sg, su, sd = (w.to(acc) for w in shared)
        out = out + F.linear(F.silu(F.linear(xf, sg)) * F.linear(xf, su), sd)
    return out.to(x.dtype)


def _expert(w, index, acc: torch.dtype) -> torch.Tensor:
    """Expert(s) `index` of a stacked weight in `acc`: INT4 stacks (`kernels.int4.Int4Weight`)
    are dequantized for just those experts, never as a whole."""
    return w[index].dequantize(acc) if isinstance(w, Int4Weight) else w[index].to(acc)


def _moe_per_pair(xf, experts, w_gate, w_up, w_down, acc):
    t, k = experts.shape
    _, inter, hid = w_gate.shape
    flat = experts.reshape(-1)
    xa = xf[:, None, :].expand(t, k, hid).reshape(-1, hid)  # [A, hidden]
    per_pair = 3 * inter * hid * torch.finfo(acc).bits // 8
    step = max(1, _MOE_GATHER_BYTES // per_pair)
    outs = []
    for s in range(0, flat.shape[0], step):
        ex, xs = flat[s : s + step], xa[s : s + step, :, None]  # [C], [C, hidden, 1]
        g = torch.bmm(_expert(w_gate, ex, acc), xs)[..., 0]  # [C, inter]
        u = torch.bmm(_expert(w_up, ex, acc), xs)[..., 0]
        h = torch.nn.functional.silu(g) * u
        outs.append(torch.bmm(_expert(w_down, ex, acc), h[..., None])[..., 0])  # [C, hidden]
    return torch.cat(outs).view(t, k, hid)


def _moe_dense(xf, local, w_gate, w_up, w_down, acc):
    t, k = local.shape
    e, _, hid = w_gate.shape
    y = torch.zeros(t, k, hid, dtype=acc, device=xf.device)
    for ex in range(e):
        h = torch.nn.functional.silu(xf @ _expert(w_gate, ex, acc).T) * (xf @ _expert(w_up, ex, acc).T)
        out = h @ _expert(w_down, ex, acc).T  # [T, hidden]
        y = torch.where((local == ex)[..., None], out[:, None, :], y)
    return y


def drafter_block_mask(q_pos: torch.Tensor, ctx_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """[B, Q, L+Q] bool: row i (position q_pos[b, i]) sees key s. Keys are the context slots
    (ctx_pos [B, L], -1 = padding: unseen) followed by the block's own rows (q_pos [B, Q]);
    causal cuts block keys after the row, a window W cuts |p - j| >= W everywhere."""
    k_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [B, L+Q]
    p, j = q_pos[:, :, None], k_pos[:, None, :]
    vis = (j >= 0).expand(-1, q_pos.shape[1], -1).clone()
    n_ctx = ctx_pos.shape[1]
    if causal:
        vis[:, :, n_ctx:] &= j[:, :, n_ctx:] <= p
    if window is not None:
        vis &= (p - j < window) & (j - p < window)
    return vis


def drafter_sdpa(q, ctx_k, ctx_v, blk_k, blk_v, mask, scale) -> torch.Tensor:
    """The drafter's torch path: cat the block onto the context, repeat K/V to Hq heads and
    run SDPA (off cuDNN) under `mask` [B, Q, L+Q] bool. Shapes as `drafter_attention`;
    returns [B, Hq, Q, D] in q.dtype. Copies the context K/V (Hq/Hkv + 1) times."""
    k = torch.cat([ctx_k, blk_k], dim=2)  # [B, Hkv, L+Q, D]
    v = torch.cat([ctx_v, blk_v], dim=2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, Hq, L+Q, D]
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)


def drafter_attention(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale, impl=None):
    """Twin of `treeflash.kernels.drafter_attention` (kernel: kernels/drafter_attn.py): the
    drafter's SDPA path, with padding rows zeroed first so that they are never read."""
    pad = (ctx_pos < 0)[:, None, :, None]  # [B, 1, L, 1]
    ctx_k, ctx_v = ctx_k.masked_fill(pad, 0), ctx_v.masked_fill(pad, 0)
    return drafter_sdpa(q, ctx_k, ctx_v, blk_k, blk_v, drafter_block_mask(q_pos, ctx_pos, causal, window), scale)


def moe_gate(logits, bias, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob,
             routed_scaling_factor):
    """Twin of `treeflash.kernels.moe_gate` (kernel: kernels/moe_router.py): the model's original
    routing, op for op (CPU results are bit-identical to it). Ids come from an unsorted topk."""
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)  # [T, E]
    choice = scores
    if topk_method == "noaux_tc":
        choice = scores + bias.float()
    if topk_method != "greedy" and n_group > 1:
        choice = _moe_limit_groups(choice, topk_method, n_group, topk_group)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def _moe_limit_groups(choice, topk_method, n_group, topk_group):
    """choice [T, E] with the experts outside the topk_group best groups set to -inf; a
    group's score is its top-2 sum (noaux_tc) or its best expert."""
    t = choice.shape[0]
    grouped = choice.view(t, n_group, -1)  # [T, G, E/G]
    if topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
    else:
        group_scores = grouped.max(-1).values
    keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))


def routing_margin(logits, bias, scoring_func, topk_method, n_group, topk_group, top_k):
    """Per row of logits [T, E], the smallest gap (float64 choice values, as `moe_gate` ranks
    them) at a routing decision: the topk_group-th / next group score, the top_k-th / next
    eligible choice. Rows with a small margin may route differently under a different float32
    sum order of the logits (a kernel against cuBLAS); tests and benchmarks exempt them."""
    logits = logits.double()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores + bias.double() if topk_method == "noaux_tc" else scores
    gap = torch.full((logits.shape[0],), float("inf"), dtype=torch.float64, device=logits.device)
    if topk_method != "greedy" and n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        gs = grouped.topk(2, -1)[0].sum(-1) if topk_method == "noaux_tc" else grouped.max(-1).values
        top = gs.topk(topk_group + 1 if topk_group < n_group else topk_group, -1)[0]
        if topk_group < n_group:
            gap = torch.minimum(gap, top[:, -2] - top[:, -1])
        choice = _moe_limit_groups(choice, topk_method, n_group, topk_group)
    top = choice.topk(top_k + 1, -1)[0]
    ok = torch.isfinite(top[:, -1])
    return torch.where(ok, torch.minimum(gap, top[:, -2] - top[:, -1]), gap)


def expert_counts(ids, last, total):
    """Reference for `treeflash.kernels.expert_counts`: zero_, scatter_add_ of ones and an add."""
    flat = ids.reshape(-1)
    last.zero_().scatter_add_(0, flat, torch.ones_like(flat))
    total += last


def tree_walk(tokens, parents, depths, valid, ancestor_mask, post, width, candidates=None):
    """Reference for `treeflash.kernels.tree_walk` (see its docstring)."""
    b, n = tokens.shape
    dev = tokens.device
    idx = torch.arange(n, device=dev)
    # Node i matches if it is the target's choice after its parent; the root always does.
    match = (tokens == post.gather(1, parents.clamp(min=0))) & (parents >= 0) & valid
    match |= idx == 0
    # Accepted = every ancestor (and itself) matched.
    accepted = ~(ancestor_mask & ~match[:, None, :]).any(-1) & valid  # [B, N]
    num_accepted = accepted.sum(-1) - 1
    # Scatter accepted node ids by depth; rejected nodes go to a scratch column.
    slot = torch.where(accepted, depths, torch.full_like(depths, width))
    path = torch.full((b, width + 1), -1, dtype=torch.long, device=dev)
    path.scatter_(1, slot, idx.expand(b, n))
    path = path[:, :width]
    deepest = path.gather(1, num_accepted[:, None])  # [B, 1]
    bonus = post.gather(1, deepest)[:, 0]
    drafts = torch.where(path[:, 1:] >= 0, tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    new_tokens = torch.cat([drafts, drafts.new_full((b, 1), -1)], 1)
    new_tokens.scatter_(1, num_accepted[:, None], bonus[:, None])
    depth = depths.gather(1, deepest)[:, 0]
    cols = [new_tokens, num_accepted[:, None], valid.sum(-1, keepdim=True) - 1, depth[:, None]]
    if candidates is not None:
        nodes = path[:, 1:, None]
        cols.append(((nodes >= 1) & (nodes <= candidates)).sum(1))  # [B, C]
    packed = torch.cat([c.long() for c in cols], dim=1)
    return path, path.clamp(min=0), num_accepted + 1, num_accepted, depth, bonus, new_tokens, packed


def topk_logprobs(logits, k):
    """Reference for `treeflash.kernels.topk_logprobs` (see its docstring).

    torch.topk's order among equal values is unspecified (and differs between CPU and CUDA), so
    the set is fixed by hand: every logit above the k-th largest, then the lowest-index logits
    equal to it; the k chosen are then ordered by (logit desc, index asc). O(V) work beyond
    torch.topk, and no full sort of the vocabulary.
    """
    x = logits.float()
    lp = torch.log_softmax(x, dim=-1)
    kth = x.topk(k, dim=-1).values[..., -1:]  # [..., 1] the k-th largest logit
    above, at = x > kth, x == kth
    take = above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k a row
    # the taken indices, ascending: taken index j goes to slot (taken before j); the rest to slot k
    slot = torch.where(take, take.cumsum(-1) - 1, k)
    vocab = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    chosen = torch.zeros(*x.shape[:-1], k + 1, dtype=torch.long, device=x.device)
    chosen = chosen.scatter_(-1, slot, vocab)[..., :k]  # [..., k]
    order = torch.sort(x.gather(-1, chosen), dim=-1, descending=True, stable=True).indices
    top_tok = chosen.gather(-1, order)
    return lp.gather(-1, top_tok), top_tok
