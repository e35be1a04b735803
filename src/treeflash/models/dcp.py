"""Decode context parallelism (DCP): a request's latent cache dealt across the N ranks of a group.

Under TP every rank holds the whole latent cache (MLA's latent is shared by all heads). With
`dcp=N` (N divides tp) the tp ranks form tp/N groups of N consecutive ranks; inside a group,
rank r (`Parallel.dcp_rank`) holds the rows of every N-th pool page of a request: page i of a
request's page list is the same page id on every rank, and on rank r it holds the request's
positions [(i*N + r) * u, (i*N + r + 1) * u) with u = the pool's page size (the dealing unit).
So every rank's share grows evenly, a page holds N x u positions of a request (N x today's
capacity for the same memory), and a rank's positions are contiguous "local" rows of its pages:
position p lives on rank (p // u) % N at local row (p // (u*N)) * u + p % u.

A forward under DCP (`models/mla.py`), per layer:
- every rank writes all the step's new latents after its local prefix (scratch rows);
- the group all-gathers its ranks' absorbed queries, so each rank attends with the group's
  N x H/tp heads over its own share (the same verify kernel, returning output and LSE); only
  group rank 0 lets the rows see the new rows (the tree mask, or causal), the others pass an
  all-false mask, so every key is counted once;
- ONE all-to-all hands each rank the N partials (output | LSE) of its own heads, merged by
  log-sum-exp (`merge`: one Triton launch reading the received buffer in place on GPU,
  `kernels/dcp_merge.py`; torch elsewhere);
- rows that stay (prefill chunks) then move to the rows their owner keeps (`settle_plan`; one
  row a request, plain decode, is at its owner's local prefix already: its final row); a
  verify's rows wait for the commit (`commit_plan`: each owner moves the accepted nodes whose
  final positions it owns out of its scratch rows).

Modelled (no process group, `Parallel(dcp_size=N)` in one process: `bench sweep --dcp-model N`
on a single-GPU preset): the rank is group rank 0, the other ranks' queries are its own repeated
and the all-to-all is the same packing done locally, so a step does one rank's work (its share,
N x its heads, the merge) and the collectives' wire time is added from a declared latency.
"""

from __future__ import annotations

import torch

from treeflash import kernels


# ---- where rows live ----------------------------------------------------------------------
def local_lens(lens: torch.Tensor, rank: int, size: int, unit: int) -> torch.Tensor:
    """How many of the positions [0, lens[b]) rank `rank` of `size` holds, dealt `unit` at a
    time (same dtype and device as lens)."""
    span = unit * size
    full, rem = torch.div(lens, span, rounding_mode="floor"), torch.remainder(lens, span)
    return full * unit + (rem - rank * unit).clamp(0, unit)


def owner(positions: torch.Tensor, size: int, unit: int) -> torch.Tensor:
    """The DCP rank holding each position."""
    return torch.remainder(torch.div(positions, unit, rounding_mode="floor"), size)


def commit_plan(prefix: torch.Tensor, accept_idx: torch.Tensor, num_rows: torch.Tensor, rank: int,
                size: int, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of a commit: accepted node accept_idx[b, i] goes to global position
    prefix[b] + i for i < num_rows[b]; this rank keeps those positions it owns. Returns
    (local prefix [B] int32, local accept [B, M] (increasing, local[j] >= j), local rows [B]) for
    `kernels.kv_commit` over the rank's rows: its scratch row local_prefix + accept moves to
    local_prefix + j, j counting the owned positions in order."""
    b, m = accept_idx.shape
    i = torch.arange(m, device=accept_idx.device)
    pos = prefix.long()[:, None] + i
    own = (owner(pos, size, unit) == rank) & (i[None, :] < num_rows.long()[:, None])
    j = torch.where(own, own.long().cumsum(1) - 1, m)  # non-owned entries go to a spare column
    local = torch.zeros(b, m + 1, dtype=accept_idx.dtype, device=accept_idx.device)
    local.scatter_(1, j, accept_idx)
    return local_lens(prefix.to(torch.int32), rank, size, unit), local[:, :m], own.sum(1)


def settle_plan(prefix: torch.Tensor, n: int, rank: int, size: int,
                unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`commit_plan` of rows written as scratch that all stay (a prefill chunk, a plain decode):
    each rank moves the ones whose positions it owns to their local rows (`kernels.kv_commit`)."""
    b = prefix.shape[0]
    idx = torch.arange(n, device=prefix.device).expand(b, n)
    rows = torch.full((b,), n, dtype=torch.long, device=prefix.device)
    return commit_plan(prefix, idx, rows, rank, size, unit)



def commit_rows(model, kv: torch.Tensor, table: torch.Tensor, prefix_lens: torch.Tensor,
                accept_idx: torch.Tensor, num_rows: torch.Tensor, page_size: int, impl: str | None) -> None:
    """Keep a verify's accepted rows: node accept_idx[b, j] to position prefix + j. Under DCP
    each rank keeps those of its positions, from its scratch rows (`models/dcp.py`)."""
    par = model.parallel
    if par.dcp_size == 1:
        kernels.kv_commit(kv, table, prefix_lens.to(torch.int32), accept_idx, num_rows, impl=impl)
        return
    lp, local, count = commit_plan(prefix_lens.to(kv.device), accept_idx.to(kv.device), num_rows.to(kv.device),
                                       par.dcp_rank, par.dcp_size, page_size)
    kernels.kv_commit(kv, table, lp, local, count, impl=impl)


# ---- the merge ----------------------------------------------------------------------------
def merge_torch(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials out [S, ..., v] (each normalised over its keys) and natural-log lse [S, ...]
    (-inf: a part that saw no key; its values are ignored, NaN or not) merged by log-sum-exp:
    (out [..., v] in out's dtype, lse [...] float32)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse = _no_key_as_minus_inf(lse.to(acc))
    m = lse.amax(0)
    m_use = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_use)  # [S, ...]; 0 for an empty part
    seen = (w > 0)[..., None]
    o = torch.where(seen, out.to(acc), torch.zeros((), dtype=acc, device=out.device))
    total = w.sum(0)
    merged = (w[..., None] * o).sum(0) / torch.where(total == 0, 1.0, total)[..., None]
    return merged.to(out.dtype), (m_use + torch.log(total)).to(torch.float32)


def _no_key_as_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    """A part whose rows saw no key may come out of a kernel with LSE NaN (log 0 of an empty sum,
    -inf - -inf): it weighs nothing, like -inf."""
    return torch.where(lse > float("-inf"), lse, torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device))


def pack(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out [..., v] and lse [...] as one [..., v + k] tensor of out's dtype: the LSE's float32 bits
    in the last k = 4 / element-size columns (what one collective carries)."""
    bits = lse.to(torch.float32).unsqueeze(-1).contiguous().view(out.dtype)
    return torch.cat([out, bits], dim=-1)


def unpack(packed: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (out [..., v], lse [...] float32)."""
    out, bits = packed.split([v, packed.shape[-1] - v], dim=-1)
    return out, bits.contiguous().view(torch.float32).squeeze(-1)


def merge(packed: torch.Tensor, v: int, impl: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the parts of `packed` [S, ..., v + k] (`pack`ed partials, one a rank): one Triton launch
    reading the buffer in place (`kernels/dcp_merge.py`) on CUDA or with impl="triton", else
    `merge_torch`. Returns (out [..., v], lse [...] float32)."""
    if impl == "torch" or (impl is None and packed.device.type != "cuda"):
        return merge_torch(*unpack(packed, v))
    from treeflash.kernels.dcp_merge import merge_packed_triton

    return merge_packed_triton(packed, v)


# ---- the collectives ----------------------------------------------------------------------
def gather_heads(q: torch.Tensor, size: int, group) -> torch.Tensor:
    """q [B, N, h, D] of every rank of the DCP group as [B, N, size*h, D] (rank r's heads at
    r*h ..): the heads each rank attends with over its share. One all-gather into one buffer; for
    one row (plain decode at batch 1) the result is a view of it, else one copy puts the heads side
    by side."""
    import torch.distributed as dist

    from treeflash.sharding import CollectiveError

    b, n, h, d = q.shape
    if group is None:  # modelled: the other ranks' queries are these again (the copy: where they land)
        parts = q.unsqueeze(0).expand(size, b, n, h, d)
    else:
        flat = torch.empty(size * b, n, h, d, dtype=q.dtype, device=q.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13)
        try:
            gather(flat, q.contiguous(), group=group)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e
        parts = flat.view(size, b, n, h, d)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, n, size * h, d)


def pack_send(out: torch.Tensor, lse: torch.Tensor, size: int) -> torch.Tensor:
    """out [B, N, size*h, v] and lse [B, N, size*h] as the all-to-all's send buffer
    [size, B, N, h, v + k] (`pack`ed, rank r's heads in part r): two launches (the pack's cat,
    the permute's copy)."""
    b, n, hh, _ = out.shape
    return pack(out, lse).view(b, n, size, hh // size, -1).permute(2, 0, 1, 3, 4).contiguous()


def exchange_partials(out: torch.Tensor, lse: torch.Tensor, size: int, group) -> torch.Tensor:
    """out [B, N, size*h, v] and lse [B, N, size*h] over this rank's share, for the group's
    heads; returns every rank's partials of this rank's h heads, `pack`ed: [size, B, N, h, v + k].
    One all-to-all, the LSE riding as extra columns."""
    import torch.distributed as dist

    from treeflash.sharding import CollectiveError

    send = pack_send(out, lse, size)
    if group is None:  # modelled: what arrives is what this rank sent (the same buffer: no copy)
        return send
    recv = torch.empty_like(send)
    try:
        dist.all_to_all_single(recv, send, group=group)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise CollectiveError(str(e)) from e
    return recv
