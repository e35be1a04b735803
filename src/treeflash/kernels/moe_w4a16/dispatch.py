"""Which W4A16 MoE kernel runs a call, and with which tiles: one table, by rows (tokens) a call.

Implementations: "mma" (`mma.py`: Gluon, the weights' MMA operand built in registers; bf16 /
fp16 x, groups of 8 x a power of two, scales in x's dtype) and "portable" (`portable.py`: Triton
`tl`, everything else, and the interpreter's fp32 tests). A row that names "mma" falls back to
"portable" for a call `mma.supported` refuses. TREEFLASH_W4A16_IMPL pins one ("auto": this
table); TREEFLASH_W4A16_MMA pins the MMA tiles (`MmaTiles.parse`).

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
from treeflash.kernels.moe_w4a16.mma import MmaTiles

MMA, PORTABLE = "mma", "portable"
IMPLS = (MMA, PORTABLE)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Calls of at most max_rows tokens run `impl` (with `tiles` for "mma", and gate_up's split
    count `split`; None: `mma.plan`'s)."""

    max_rows: int
    impl: str
    tiles: MmaTiles | None = None
    split: int | None = None


RULES: tuple[Rule, ...] = (
    Rule(8, MMA, MmaTiles(8, 32, 64, 4, 4, 2)),
    Rule(64, MMA, MmaTiles(8, 32, 64, 4, 4, 2)),
    Rule(512, MMA, MmaTiles(16, 32, 64, 4, 4, 2)),
    Rule(1 << 62, MMA, MmaTiles(32, 32, 64, 2, 4, 2)),
)


def rule(tokens: int) -> Rule:
    """The table's row for a call of `tokens` rows."""
    return next(r for r in RULES if tokens <= r.max_rows)


def impl(tokens: int) -> str:
    """The implementation for `tokens` rows: TREEFLASH_W4A16_IMPL if set to one, else the table."""
    pinned = knobs.get("TREEFLASH_W4A16_IMPL")
    if pinned and pinned != "auto":
        return pinned
    return rule(tokens).impl


def mma_split(tokens: int) -> int | None:
    """gate_up's split count the table fixes for `tokens` rows (None: planned per call)."""
    return rule(tokens).split


def mma_tiles(tokens: int, top_k: int, experts: int) -> MmaTiles:
    """The MMA kernel's tiles: TREEFLASH_W4A16_MMA if set, else the table's."""
    if knobs.get("TREEFLASH_W4A16_MMA"):
        return MmaTiles.parse(knobs.get_ints("TREEFLASH_W4A16_MMA"))
    return rule(tokens).tiles or MmaTiles()
