"""Test data for kernels: tolerances as data, poisoned paged caches, random trees.

Shared by tests/kernels (CPU, Triton interpreter) and the GPU benchmark's correctness pass,
so both check the same way: against a float64 reference, with NaN in every slot that must
not be read and page-table padding that points past the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.kvcache.format import fp8_row_bytes, quantize_rows

# Max |out - ref| / max(|ref|) per compute dtype of the inputs, and the cosine floor.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1.5e-2,
}
LSE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
COSINE_MIN = 0.9999
PAD_PAGE = 1 << 30  # page-table padding: far past any pool, so a stray read faults or fails


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (in float64)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "out",
                 table: dict[torch.dtype, float] | None = None) -> None:
    """Same shape, same NaN/inf positions, relative error under the dtype's tolerance, cosine."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    bad_out, bad_ref = ~torch.isfinite(out64), ~torch.isfinite(ref64)
    assert torch.equal(bad_out, bad_ref), f"{what}: non-finite positions differ"
    assert torch.equal(out64[bad_out].nan_to_num(0.0), ref64[bad_ref].nan_to_num(0.0)), what
    out64, ref64 = out64[~bad_out], ref64[~bad_ref]
    if ref64.numel() == 0:
        return
    tol = (table or TOLERANCES)[dtype]
    err = relative_error(out64, ref64)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g} ({dtype})"
    cos = torch.nn.functional.cosine_similarity(out64.flatten(), ref64.flatten(), dim=0).item()
    assert cos >= COSINE_MIN or ref64.abs().max() == 0, f"{what}: cosine {cos:.6f} < {COSINE_MIN}"


@dataclass
class PagedKV:
    """A poisoned paged cache: kv_cache [num_pages, page_size, D], page_table [B, max_pages]."""

    kv_cache: torch.Tensor
    page_table: torch.Tensor
    lens: torch.Tensor  # [B] int32, rows written per request
    pages: list[list[int]]


def page_lists(lens: list[int], page_size: int, layout: str, spare: int = 3,
               generator: torch.Generator | None = None) -> tuple[list[list[int]], int]:
    """Pages of each request and the pool size. layout: "contiguous" (each request one run,
    gaps of spare pages between), "scattered" (every page anywhere, shuffled)."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare * (len(lens) + 1)
    if layout == "contiguous":
        out, start = [], spare
        for k in need:
            out.append(list(range(start, start + k)))
            start += k + spare
        return out, num_pages
    if layout != "scattered":
        raise ValueError(f"layout must be contiguous or scattered, got {layout!r}")
    perm = torch.randperm(num_pages, generator=generator).tolist()
    out, i = [], 0
    for k in need:
        out.append(perm[i:i + k])
        i += k
    return out, num_pages


def build_page_table(pages: list[list[int]], pad: int = PAD_PAGE, extra: int = 1) -> torch.Tensor:
    """[B, max_pages + extra] int32, unused entries = pad (out of range)."""
    width = max(len(p) for p in pages) + extra
    table = torch.full((len(pages), width), pad, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return table


def random_paged_kv(lens: list[int], dim: int, page_size: int, dtype: torch.dtype,
                    layout: str = "contiguous", device: str | torch.device = "cpu",
                    generator: torch.Generator | None = None, scale: float = 1.0,
                    v_dim: int | None = None) -> PagedKV:
    """Random rows for positions 0 .. lens[b]-1 of each request; every other slot is NaN
    (unused pages and the tails of last pages), page-table padding is out of range.
    dtype torch.uint8: fp8_e4m3 rows (`kvcache.format`; v_dim = the quantised part) of the same
    random values, every other slot's bytes 0xFF (codes, scales and rope all NaN)."""
    pages, num_pages = page_lists(lens, page_size, layout, generator=generator)
    kv = torch.full((num_pages, page_size, dim), float("nan"), dtype=torch.float32)
    for p, n in zip(pages, lens):
        rows = torch.randn(n, dim, generator=generator) * scale
        idx = torch.arange(n)
        kv[torch.tensor(p, dtype=torch.long)[idx // page_size], idx % page_size] = rows
    if dtype == torch.uint8:
        if v_dim is None:
            raise ValueError("fp8_e4m3 rows need v_dim")
        written = ~kv[..., 0].isnan()
        rows = torch.full((num_pages, page_size, fp8_row_bytes(dim, v_dim)), 0xFF, dtype=torch.uint8)
        rows[written] = quantize_rows(kv[written], v_dim)
        kv = rows
    return PagedKV(kv.to(device=device, dtype=dtype), build_page_table(pages).to(device),
                   torch.tensor(lens, dtype=torch.int32, device=device), pages)


def random_tree(n: int, generator: torch.Generator | None = None, bushy: bool = True) -> list[int]:
    """Parents of nodes 0..n-1 in topological order (parent[0] = -1). bushy: each node hangs
    under a random earlier node biased to shallow ones; otherwise a long chain with side twigs."""
    parents = [-1]
    for i in range(1, n):
        if bushy:
            hi = max(1, min(i, 1 + int(torch.randint(0, 4, (1,), generator=generator))))
            parents.append(int(torch.randint(0, hi, (1,), generator=generator)))
        else:
            jitter = int(torch.randint(0, 4, (1,), generator=generator)) == 0
            parents.append(max(0, i - 2) if jitter else i - 1)
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: mask[i, j] = j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def chain_mask(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


def random_tree_masks(batch: int, n: int, generator: torch.Generator | None = None,
                      bushy: bool = True) -> torch.Tensor:
    """[B, N, N] bool ancestor masks of independent random trees."""
    return torch.stack([ancestor_mask(random_tree(n, generator, bushy)) for _ in range(batch)])
