"""Which W4A16 MoE kernel runs a call, and with which tiles: one table, by rows (tokens) a call.

Implementations: "mma" (`mma.py`: Gluon, the weights' MMA operand built in registers; bf16 /
fp16 x, groups of 8 x a power of two, scales in x's dtype), "portable" (`portable.py`: Triton
`tl`, everything else, and the interpreter's fp32 tests) and "humming" (`humming.py`:
humming-kernels on a copy of the experts in its layout, made at load time). A row that names
"mma" falls back to "portable" for a call `mma.supported` refuses; a row marked humming runs it
where the layer holds a copy that takes the call, else the row's own kernel. TREEFLASH_W4A16_IMPL
pins one ("auto": this table); TREEFLASH_W4A16_MMA pins the MMA tiles (`MmaTiles.parse`).

humming's rows: H100, 2026-12-07 (benchmarks/results/h100-20261207-moe-w4a16/, per MoE layer at
Kimi K2 TP8 in a CUDA graph), humming against the best of ours then (the portable kernel):
93.3 / 106.3 / 127.0 / 159.0 us at 1 / 2 / 4 / 8 rows against 41.7 / 63.9 / 97.5 / 141.7 (ours),
215.5 / 301.3 / 388.0 / 502.6 / 648.4 / 921.3 / 1375.5 us at 16 .. 1024 rows against 297.5 /
409.4 / 582.1 / 742.2 / 832.8 / 1404.6 / 1934.8 (humming 0.57-0.78x ours). So humming from 9
rows then. The MMA kernel against humming, one call (H100, 2026-12-07,
benchmarks/results/h100-20261207-w4a16-mma/): MMA 27.9 / 43.8 / 69.5 / 106.8 / 191.8 us at 1 / 2 /
4 / 8 / 16 rows against humming's 94.2 / 107.0 / 124.0 / 158.2 / 212.8, so ours up to 16 rows; 32+
rows were cut by that run's time cap, and humming beat the portable kernel there by more than the
MMA kernel did (the runs before), so humming stays from 17 rows until one call times both.

The tiles below are sm_90 compile results, not yet timed (benchmarks/notes/moe-w4a16.md has the
SASS figures and the prediction; `benchmarks/gpu_w4a16.sh` times every row's candidates and
writes `w4a16-dispatch.txt`, this table's rows as that run measured them best):
- up to 8 rows, blocks of 8 columns and no routing launch (T <= block_m: SLOTS); gate_up 32 rows
  of gate and of up a program (88 registers: 5 programs an SM), down 64;
- 16 - 64 rows (1 - 2 pairs an expert): blocks of 8 after the routing launch;
- 128 - 512: blocks of 16 (3 - 11 pairs an expert at Kimi K2 TP8);
- more: blocks of 32 with 2-block steps (x's operand grows with the block: 32 NJ BM / 32
  registers a thread and buffer).
"""

from __future__ import annotations

import dataclasses

from treeflash import knobs

MMA, PORTABLE, HUMMING = "mma", "portable", "humming"
IMPLS = (MMA, PORTABLE, HUMMING)


@dataclasses.dataclass(frozen=True)
class MmaTiles:
    """One call's tiles. block_m: columns (routed pairs) a block, 8 or more (the routing's block
    size; the MMA's N); gu_n: gate rows (and as many up rows) a gate_up program; down_n: output
    rows a down program; nj: 32-long K blocks a step (a thread's 16-byte load at 4); warps;
    depth: steps the INT4 weights are loaded ahead (1 or 2). gate_up's 2 gu_n and down's down_n
    rows are 16 x warps x a power of two."""

    block_m: int = 8
    gu_n: int = 32
    down_n: int = 64
    nj: int = 4
    warps: int = 4
    depth: int = 2

    def spec(self) -> str:
        return ":".join(str(v) for v in dataclasses.astuple(self))

    @staticmethod
    def parse(values) -> MmaTiles:
        t = MmaTiles(*values)
        if t.depth not in (1, 2):
            raise ValueError(f"W4A16 MMA tiles {t.spec()}: depth must be 1 or 2")
        for name in ("block_m", "gu_n", "down_n", "nj", "warps"):
            v = getattr(t, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"W4A16 MMA tiles {t.spec()}: {name} must be a power of two")
        if t.block_m < 8 or 2 * t.gu_n % (16 * t.warps) or t.down_n % (16 * t.warps):
            raise ValueError(f"W4A16 MMA tiles {t.spec()}: block_m >= 8, 2 gu_n and down_n multiples of 16 x warps")
        return t


@dataclasses.dataclass(frozen=True)
class Rule:
    """Calls of at most max_rows tokens run `impl` (with `tiles` for "mma", and gate_up's split
    count `split`; None: `mma.plan`'s), or humming where `humming` and the layer has its copy."""

    max_rows: int
    impl: str
    tiles: MmaTiles | None = None
    split: int | None = None
    humming: bool = False


RULES: tuple[Rule, ...] = (
    Rule(8, MMA, MmaTiles(8, 32, 64, 4, 4, 2)),
    Rule(16, MMA, MmaTiles(8, 32, 64, 4, 4, 2)),
    Rule(64, MMA, MmaTiles(8, 32, 64, 4, 4, 2), humming=True),
    Rule(512, MMA, MmaTiles(16, 32, 64, 4, 4, 2), humming=True),
    Rule(1 << 62, MMA, MmaTiles(32, 32, 64, 2, 4, 2), humming=True),
)


def rule(tokens: int) -> Rule:
    """The table's row for a call of `tokens` rows."""
    return next(r for r in RULES if tokens <= r.max_rows)


def impl(tokens: int, humming_ready: bool = False) -> str:
    """The implementation for `tokens` rows: TREEFLASH_W4A16_IMPL if set to one, else the table's
    (humming where its row says so and humming_ready: the layer's copy takes this call)."""
    pinned = knobs.get("TREEFLASH_W4A16_IMPL")
    if pinned and pinned != "auto":
        return pinned
    r = rule(tokens)
    return HUMMING if r.humming and humming_ready else r.impl


def mma_split(tokens: int) -> int | None:
    """gate_up's split count the table fixes for `tokens` rows (None: planned per call)."""
    return rule(tokens).split


def mma_tiles(tokens: int, top_k: int, experts: int) -> MmaTiles:
    """The MMA kernel's tiles: TREEFLASH_W4A16_MMA if set, else the table's."""
    if knobs.get("TREEFLASH_W4A16_MMA"):
        return MmaTiles.parse(knobs.get_ints("TREEFLASH_W4A16_MMA"))
    return rule(tokens).tiles or MmaTiles()
