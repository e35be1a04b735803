"""v6 (seesaw, mla_verify_v6): the pair recurrence of the two warpgroups' running maxima, row
sums and output halves, simulated in torch on the CPU exactly as the kernel orders it
(log2 domain, bf16 P, -inf rows), against a float64 softmax; plus the config / routing / bench
wiring. The Gluon kernel itself runs only on an sm_90 GPU (bench_kernel.py --check-only v6)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

NEG = float("-inf")


def _softmax_step(s, m_prev, p_dtype):
    """mla_verify_v6._softmax_step on already scaled / masked S (log2 domain)."""
    m_new = torch.maximum(m_prev, s.max(dim=1).values)
    m_use = torch.where(m_new == NEG, torch.zeros_like(m_new), m_new)
    alpha = torch.exp2(m_prev - m_use)
    p = torch.exp2(s - m_use[:, None]).to(p_dtype)
    return p, alpha, m_new, p.float().sum(dim=1)


def seesaw(s_log2: torch.Tensor, v: torch.Tensor, p_dtype=torch.bfloat16, tile: int = 64):
    """The v6 kernel's arithmetic: s_log2 [M, L] (scaled, -inf where masked), v [L, 2 * half].
    Tiles 2k go to "WG0" (owns O_L), 2k + 1 to "WG1" (owns O_R); returns (O normalised, log2
    LSE) as WG0 / WG1 store them (each half with its own copy of l)."""
    m_rows, length = s_log2.shape
    half = v.shape[1] // 2
    n_tiles = -(-length // tile)
    o_l = torch.zeros(m_rows, half)
    o_r = torch.zeros(m_rows, half)
    m = torch.full((m_rows,), NEG)
    l0 = torch.zeros(m_rows)
    vq = v.to(p_dtype).float()  # the cache's values
    for k in range(-(-n_tiles // 2)):
        t0, t1 = 2 * k, 2 * k + 1
        s0 = s_log2[:, t0 * tile:(t0 + 1) * tile]
        v0 = vq[t0 * tile:(t0 + 1) * tile]
        # WG0: softmax0 from m; P0, m0, a0 to WG1 (through shared memory: the same values)
        p0, a0, m0, rs0 = _softmax_step(s0, m, p_dtype)
        o_l = o_l * a0[:, None] + p0.float() @ v0[:, :half]
        l0 = l0 * a0 + rs0
        # WG1: O_R *= a0; O_R += P0 V0_R; softmax1 from m0
        o_r = o_r * a0[:, None] + p0.float() @ v0[:, half:]
        if t1 < n_tiles:
            s1 = s_log2[:, t1 * tile:(t1 + 1) * tile]
            v1 = vq[t1 * tile:(t1 + 1) * tile]
            p1, a1, m1, rs1 = _softmax_step(s1, m0, p_dtype)
            o_r = o_r * a1[:, None] + p1.float() @ v1[:, half:]
            o_l = o_l * a1[:, None] + p1.float() @ v1[:, :half]
        else:  # odd last tile: m1 = m0, a1 = 1, rowsum 0
            m1, a1, rs1 = m0, torch.ones(m_rows), torch.zeros(m_rows)
        l0 = l0 * a1 + rs1  # WG0, with WG1's rowsum
        m = m1
    l_r = l0.clone()  # WG0 hands l to WG1 once (x[_XL])
    l_safe = torch.where(l0 == 0, torch.ones_like(l0), l0)
    l_safe_r = torch.where(l_r == 0, torch.ones_like(l_r), l_r)
    out = torch.cat([o_l / l_safe[:, None], o_r / l_safe_r[:, None]], dim=1)
    lse2 = torch.where(l0 == 0, torch.full_like(l0, NEG), m + torch.log2(l_safe))
    return out, lse2


def _reference(s_log2, v):
    s = s_log2.double()
    m = s.max(dim=1, keepdim=True).values
    m = torch.where(m == NEG, torch.zeros_like(m), m)
    p = torch.exp2(s - m)
    l = p.sum(dim=1, keepdim=True)
    out = (p @ v.double()) / torch.where(l == 0, torch.ones_like(l), l)
    lse2 = torch.where(l[:, 0] == 0, torch.full_like(l[:, 0], NEG), m[:, 0] + torch.log2(l[:, 0]))
    return out, lse2


@pytest.mark.parametrize("length", [64, 128, 192, 320, 64 * 9 + 17, 1000])
@pytest.mark.parametrize("masking", ["none", "tail", "late_rows", "growing_max"])
def test_seesaw_recurrence_matches_softmax(length, masking):
    g = torch.Generator().manual_seed(length)
    m_rows, half = 48, 32
    s = torch.randn(m_rows, length, generator=g) * 3.0
    v = torch.randn(length, 2 * half, generator=g)
    if masking == "tail":  # keys past t_hi and a random tree mask on the last tile
        s[:, length - 5:] = NEG
        tail = torch.rand(m_rows, min(64, length), generator=g) < 0.4
        s[:, length - tail.shape[1]:][tail] = NEG
    elif masking == "late_rows":  # rows that see nothing in the first tiles (and one never)
        s[: m_rows // 2, : min(130, length - 1)] = NEG
        s[-1] = NEG
    elif masking == "growing_max":  # the max jumps in odd tiles: a1 << 1, a0 = 1
        s = s + torch.arange(length).float()[None, :] * 0.05
    out, lse2 = seesaw(s, v)
    ref, ref_lse2 = _reference(s, v)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse2)
    assert torch.equal(torch.isfinite(lse2), finite)
    assert torch.allclose(lse2[finite].double(), ref_lse2[finite], atol=1e-3, rtol=1e-4)
    if masking == "late_rows":  # a row that sees nothing: 0 output, -inf LSE, no NaN
        assert torch.all(out[-1] == 0) and lse2[-1] == NEG
    assert not torch.isnan(out).any()


def test_seesaw_equals_one_stream_fp32():
    """With fp32 P the pair recurrence is the single-stream online softmax (v5b's) up to
    rounding: the rescales commute."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(16, 64 * 7, generator=g) * 4
    v = torch.randn(64 * 7, 16, generator=g)
    out, lse2 = seesaw(s, v, p_dtype=torch.float32)
    ref, ref_lse2 = _reference(s, v)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse2.double(), ref_lse2, atol=1e-5)
    assert math.isfinite(float(lse2.max()))


def test_v6_config_routing_and_cpu_fallback(monkeypatch):
    """KernelConfig(version=6) / TREEFLASH_VERIFY_KERNEL=v6 / the bench's v6 variants; on CPU
    a v6 config runs v4 (as v5 does) and is exact."""
    from treeflash.bench.kernel import VARIANTS
    from treeflash.kernels import mla_verify as mv
    from treeflash.kernels import reference
    from treeflash.kernels.testing import random_paged_kv, random_tree_masks

    bf16 = torch.bfloat16
    monkeypatch.setattr(mv, "_interpreting", lambda: False)
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "v6")
    cfg = mv.default_config(264, bf16, True, 64, nodes=33)
    assert cfg == mv.KernelConfig(64, 64, 4, 1, version=6, tma=True, fine_release=True,
                                 combine_wide=True)
    assert mv.pick_config(264, bf16, True, version=6) == replace(cfg, combine_wide=False)
    assert mv.default_config(264, bf16, False, 64, nodes=33).version == 4  # CPU: never Gluon
    assert mv.default_config(264, bf16, True, 1, nodes=33).version == 2  # gathered rows: as v5
    monkeypatch.delenv("TREEFLASH_VERIFY_KERNEL")
    assert mv.default_config(264, bf16, True, 64, nodes=33).version == 5  # the default stays v5b
    monkeypatch.setattr(mv, "_interpreting", lambda: True)
    v6 = VARIANTS["v6"](256)["config"]
    assert v6.version == 6
    assert VARIANTS["v6direct"](8)["num_splits"] == 1 and VARIANTS["v6direct"](8)["config"].version == 6
    g = torch.Generator().manual_seed(5)
    kv = random_paged_kv([305, 75], 48, 64, torch.float32, "scattered", "cpu", g)
    q = torch.randn(2, 5, 3, 48, generator=g)
    mask = random_tree_masks(2, 5, g)
    prefix = torch.tensor([300, 70], dtype=torch.int32)
    assert not mv._v5_supported(q, kv.kv_cache, 32)
    out, lse = mv.mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask,
                                              48 ** -0.5, 32, config=replace(v6, block_m=16,
                                                                             block_n=16))
    ref, ref_lse = reference.mla_verify_attention(q.double(), kv.kv_cache.double(),
                                                  kv.page_table, prefix, mask, 48 ** -0.5, 32)
    assert torch.allclose(out.double(), ref, atol=1e-4)
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-4)


def test_v6_check_cases_mirror_v5b():
    """check_gpu's v6 cases: every v5 case re-tagged, plus v6's own (odd tile counts, strided q)."""
    import inspect

    from treeflash.bench import kernel as bk

    src = inspect.getsource(bk.check_gpu)
    assert 'replace("v5", "v6", 1)' in src and "v6qstrided" in src
    assert "v6" in bk.VARIANTS and "v6direct" in bk.VARIANTS


# ------------------------------------------------------------------ the barrier protocol
# A model of the v6 kernel's three partitions as generators of the operations they issue, in
# the kernel's order (mla_verify_v6 `_wg0_seesaw`, `_wg1_seesaw`, `_loader_seesaw`), run under
# random interleavings with mbarrier parity semantics (count 1; `expect` = an arrival plus
# transaction bytes that complete when the TMA lands), TMA copies that land at random later
# steps, and async wgmma reads that last from issue to the wgmma wait that covers them. It
# checks: no deadlock, every read sees the tile / pair it expects, no write (TMA, P, zeroing,
# row vectors, the staged epilogue) to a region an in-flight wgmma or TMA still uses.

class _Bar:
    def __init__(self):
        self.phase, self.pending, self.tx = 0, 1, 0

    def arrive(self):
        self.pending -= 1
        self._maybe_flip()

    def _maybe_flip(self):
        if self.pending == 0 and self.tx == 0:
            self.phase ^= 1
            self.pending = 1

    def done(self, parity):  # try_wait.parity: the phase with this parity has completed
        return self.phase != parity


def _wg0(k_pairs, n_tiles, n_full, stage):
    yield ("wait", "q_full", 0)
    for k in range(k_pairs):
        ph, t0 = k & 1, 2 * k
        yield ("wait", "full0", ph)
        if t0 >= n_full:
            yield ("wait", "full1", ph)
            yield ("write", ["L0", "R0"], ("Z", t0), t0)
        yield ("issue", [("Q", "Q"), ("L0", t0)])
        yield ("wait", "full1", ph)
        yield ("issue", [("Q", "Q"), ("R0", t0), ("rope0", ("K", t0))])
        yield ("wgwait", 0)
        yield ("arrive", "go")
        yield ("write", ["rope0"], ("P", t0), None)
        yield ("write", ["XM0", "XA0"], k, None)
        yield ("arrive", "p0_full")
        yield ("issue", [("L0", t0)])  # PV0_L, P0 from registers
        yield ("wgwait", 0)
        yield ("arrive", "empty0")
        yield ("wait", "p1_full", ph)
        yield ("read", ["XM1", "XA1", "XR1"], k)
        if t0 + 1 < n_tiles:
            yield ("issue", [("rope1", ("P", t0 + 1)), ("L1", t0 + 1)])  # PV1_L
            yield ("wgwait", 0)
            yield ("arrive", "empty2")
    yield ("write", ["XL"], "l", None)
    yield ("arrive", "l_full")
    if stage:
        yield ("write", ["L0"], "stage", None)


def _wg1(k_pairs, n_tiles, n_full, stage):
    yield ("wait", "q_full", 0)
    for k in range(k_pairs):
        ph, t0, t1 = k & 1, 2 * k, 2 * k + 1
        yield ("wait", "go", ph)
        if t1 < n_tiles:
            yield ("wait", "full2", ph)
            if t1 >= n_full:
                yield ("wait", "full3", ph)
                yield ("write", ["L1", "R1"], ("Z", t1), t1)
            yield ("issue", [("Q", "Q"), ("rope1", ("K", t1)), ("L1", t1)])
            yield ("wait", "full3", ph)
            yield ("issue", [("Q", "Q"), ("R1", t1)])
            yield ("wait", "p0_full", ph)
            yield ("read", ["XM0", "XA0"], k)
            yield ("issue", [("rope0", ("P", t0)), ("R0", t0)])  # PV0_R
            yield ("wgwait", 1)
            yield ("write", ["rope1"], ("P", t1), None)
            yield ("write", ["XM1", "XA1", "XR1"], k, None)
            yield ("arrive", "p1_full")
            yield ("wgwait", 0)
            yield ("arrive", "empty1")
            yield ("issue", [("R1", t1)])  # PV1_R, P1 from registers
            yield ("wgwait", 0)
            yield ("arrive", "empty3")
        else:
            yield ("wait", "p0_full", ph)
            yield ("read", ["XM0", "XA0"], k)
            yield ("issue", [("rope0", ("P", t0)), ("R0", t0)])
            yield ("write", ["XM1", "XA1", "XR1"], k, None)
            yield ("arrive", "p1_full")
            yield ("wgwait", 0)
            yield ("arrive", "empty1")
    yield ("wait", "l_full", 0)
    yield ("read", ["XL"], "l")
    if stage:
        yield ("write", ["Q"], "stage", None)


def _loader(k_pairs, n_tiles):
    yield ("tma", "q_full", {"Q": "Q"})
    for k in range(k_pairs):
        ph, t0, t1 = k & 1, 2 * k, 2 * k + 1
        yield ("wait", "empty0", ph ^ 1)
        yield ("tma", "full0", {"L0": t0})
        yield ("wait", "empty1", ph ^ 1)
        yield ("tma", "full1", {"R0": t0, "rope0": ("K", t0)})
        if t1 < n_tiles:
            yield ("wait", "empty2", ph ^ 1)
            yield ("tma", "full2", {"L1": t1, "rope1": ("K", t1)})
            yield ("wait", "empty3", ph ^ 1)
            yield ("tma", "full3", {"R1": t1})


def _run_protocol(n_tiles, n_full, seed, stage=False):
    import random

    rng = random.Random(seed)
    k_pairs = (n_tiles + 1) // 2
    bars = {b: _Bar() for b in ("full0", "full1", "full2", "full3", "empty0", "empty1", "empty2",
                                "empty3", "go", "p0_full", "p1_full", "l_full", "q_full")}
    mem = {}  # region -> content
    tma_busy = {}  # region -> pending TMA id
    readers = {}  # region -> set of (partition, group id)
    groups = {0: [], 1: []}  # partition -> [(gid, [(region, expected)])] in commit order
    pending_tma = []  # (id, bar, {region: content})
    parts = {0: _wg0(k_pairs, n_tiles, n_full, stage), 1: _wg1(k_pairs, n_tiles, n_full, stage),
             2: _loader(k_pairs, n_tiles)}
    cur = {p: next(g) for p, g in parts.items()}
    errors, gid = [], 0

    def same(region, expect):
        got = mem.get(region)
        if region in ("L0", "R0", "L1", "R1") and isinstance(expect, int):
            return got in (expect, ("Z", expect))  # value chunks: as loaded or zeroed
        return got == expect

    def write(region, value, expect_before, who):
        if tma_busy.get(region) is not None:
            errors.append(f"{who} writes {region} while a TMA fills it")
        if readers.get(region):
            errors.append(f"{who} writes {region} while wgmma {readers[region]} reads it")
        if expect_before is not None and not same(region, expect_before[1]):
            errors.append(f"{who} zeroes {region} holding {mem.get(region)}")
        mem[region] = value

    for _ in range(100000):
        runnable = []
        for p, op in cur.items():
            if op is None:
                continue
            if op[0] == "wait" and not bars[op[1]].done(op[2]):
                continue
            runnable.append(p)
        choices = runnable + (["tma"] if pending_tma else [])
        if not choices:
            break
        pick = rng.choice(choices)
        if pick == "tma":  # one pending copy lands
            tid, bar, regions = pending_tma.pop(rng.randrange(len(pending_tma)))
            for r, v in regions.items():
                mem[r] = v
                tma_busy[r] = None
            bars[bar].tx -= 1
            bars[bar]._maybe_flip()
            continue
        op = cur[pick]
        kind = op[0]
        if kind == "arrive":
            bars[op[1]].arrive()
        elif kind == "tma":
            bar, regions = op[1], op[2]
            for r in regions:
                if tma_busy.get(r) is not None or readers.get(r):
                    errors.append(f"TMA into {r} while busy / read by {readers.get(r)}")
                tma_busy[r] = gid
            bars[bar].tx += 1
            bars[bar].arrive()  # expect: the loader's arrival
            pending_tma.append((gid, bar, dict(regions)))
            gid += 1
        elif kind == "write":
            for r in op[1]:
                write(r, op[2], (None, op[3]) if op[3] is not None else None, f"part {pick}")
        elif kind == "read":
            for r in op[1]:
                if mem.get(r) != op[2]:
                    errors.append(f"part {pick} reads {r} = {mem.get(r)}, expected {op[2]}")
        elif kind == "issue":
            for r, expect in op[1]:
                if tma_busy.get(r) is not None or not same(r, expect):
                    errors.append(f"part {pick} wgmma reads {r} = {mem.get(r)}, expected {expect}")
                readers.setdefault(r, set()).add((pick, gid))
            groups[pick].append((gid, [r for r, _ in op[1]]))
            gid += 1
        elif kind == "wgwait":
            while len(groups[pick]) > op[1]:
                g, regs = groups[pick].pop(0)
                for r in regs:
                    readers[r].discard((pick, g))
        cur[pick] = next(parts[pick], None)
    left = {p: op for p, op in cur.items() if op is not None}
    return errors, left


@pytest.mark.parametrize("n_tiles", [0, 1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("stage", [False, True])
def test_seesaw_barrier_protocol(n_tiles, stage):
    """No deadlock, no stale read, no write under an in-flight reader, for every tile count
    (odd / even / zero), every masked-tail start, 40 random interleavings each."""
    for n_full in range(n_tiles + 1):
        for seed in range(40):
            errors, left = _run_protocol(n_tiles, n_full, seed * 7919 + n_tiles, stage)
            assert not left, f"deadlock n_tiles={n_tiles} n_full={n_full} seed={seed}: {left}"
            assert not errors, f"n_tiles={n_tiles} n_full={n_full} seed={seed}: {errors[:3]}"


def test_protocol_model_catches_a_release_race():
    """The model is not vacuous: P read from shared by the owner too (rope chunk read by both
    warpgroups but freed by one) is a race it reports."""
    global _wg1
    real = _wg1

    def racy(k_pairs, n_tiles, n_full, stage):
        for op in real(k_pairs, n_tiles, n_full, stage):
            if op[0] == "issue" and op[1] and op[1][0][0] == "R1" and len(op[1]) == 1:
                op = ("issue", [("rope1", ("P", op[1][0][1])), ("R1", op[1][0][1])])
            yield op

    _wg1 = racy
    try:
        found = any(_run_protocol(6, 6, seed)[0] for seed in range(200))
    finally:
        _wg1 = real
    assert found
