"""The environment variables treeflash reads, in one place: each one's default, accepted values and effect.

Environment variables are for what a user or an operator sets: the server's API key, the
tensor-parallel timeout, the commit a benchmark records, kernel overrides for bug reports
(TREEFLASH_VERIFY_KERNEL, TREEFLASH_W4A16_IMPL), and the INT4 MoE's load-time copy and MMA tiles
(still variables: they are read in kernels/moe_w4a16/, below the models). How a fused step
runs is the models' runtime config (`runtime.RuntimeOptions`, `--runtime-option NAME=VALUE`),
not a variable read inside them (the speculative step's A/B switches included);
`MOVED` names the variables that became options (setting one is an error that says which).
Reading a variable through `get` checks its value: a typo such as TREEFLASH_VERIFY_KERNEL=fast is
an error naming the accepted values, not a silent default. `treeflash doctor` reports every switch set away from its
default, every TREEFLASH_* name that is not one of these, and the debugging variables of CUDA,
Triton and torch that slow every step (`SLOW_FOREIGN`; `check_environment`): the first place to
look when a run is slower than the record.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

PREFIX = "TREEFLASH_"
VERIFY_KERNELS = ("auto", "portable")  # kernels/mla_verify/__init__.py `dispatch` reads them


@dataclass(frozen=True)
class Knob:
    name: str
    default: str | None  # None: unset (the reader decides)
    values: tuple[str, ...] | None  # accepted values; None: its reader parses and checks it
    doc: str
    switch: bool = True  # a speed / A-B switch (doctor warns when it is set away from its default)
    secret: bool = False  # never printed
    ints: tuple[int, ...] = ()  # a list of that many positive integers separated by ':' (`get_ints`)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    # the operator's: a kernel override for bug reports
    Knob("TREEFLASH_VERIFY_KERNEL", "auto", VERIFY_KERNELS,
         "the MLA verify attention kernel: auto = the dispatch table (the Hopper kernel on sm_90); "
         "portable = the portable Triton kernels everywhere (a bug-report override; "
         "kernels/mla_verify/__init__.py)"),
    # the INT4 MoE: a kernel override for bug reports, the load-time copy's choice, the MMA tiles (tuning)
    Knob("TREEFLASH_W4A16_IMPL", "auto", ("auto", "mma", "portable", "humming"),
         "pins the INT4 MoE kernel (auto: kernels/moe_w4a16/dispatch.py's table by rows; humming needs "
         "the layer's copy)"),
    Knob("TREEFLASH_W4A16_HUMMING", "auto", ("auto", "0", "1"),
         "a copy of the INT4 experts in humming-kernels' layout, made at load time for the rows it is "
         "faster at (auto: where it imports and fits; 1: an error where not; kernels/moe_w4a16/humming.py)"),
    Knob("TREEFLASH_W4A16_MMA", None, None,
         "the INT4 MoE MMA kernel's tiles, BLOCK_M:GU_N:DOWN_N:NJ:WARPS:DEPTH (tuning; kernels/moe_w4a16/mma.py)",
         ints=(6,)),
    # serving, parallelism, benchmarks
    Knob("TREEFLASH_API_KEY", None, None, "the server's API key (default of `serve --api-key`)",
         switch=False, secret=True),
    Knob("TREEFLASH_DIST_TIMEOUT", "600", None,
         "seconds a tensor-parallel collective may wait before the run fails", switch=False),
    Knob("TREEFLASH_COMMIT", None, None,
         "the commit written into benchmark results (a device copy's .git may be stale)", switch=False),
)}

# Variables no longer read: what replaced each (a run that sets one is stopped, so that an A/B
# measurement cannot silently run the defaults).
_OPTION = "it is the runtime option {}: give --runtime-option {}=0 (runtime.RuntimeOptions)"
_GONE = ("removed: the alternative measured slower and is no fallback (benchmarks/DESIGN_NOTES.md "
         "section {}; in git at 7fcf092)")
MOVED: dict[str, str] = {
    **{f"TREEFLASH_{env}": _OPTION.format(opt, opt) for env, opt in (
        ("FUSED_NORM", "fused_norm"), ("FUSED_A", "fused_a"), ("MLA_PREP", "mla_prep"),
        ("HEAD_MATMUL", "head_matmul"), ("ROPE_IN_ABSORB", "rope_in_absorb"), ("FUSED_GATE", "fused_gate"),
        ("SPLIT_ROUTER", "split_router"), ("MOE_SHARED", "moe_shared"))},
    **{f"TREEFLASH_{env}": f"it is the runtime option {opt}: give --runtime-option {opt}=VALUE (runtime.RuntimeOptions)"
       for env, opt in (("MOE_TILES", "moe_tiles"), ("MOE_SPLIT_K", "moe_split_k"), ("W4A16_TILES", "w4a16_tiles"),
                        ("W4A16_SPLIT_K", "w4a16_split_k"), ("DRAFTER_ATTN", "drafter_attention"),
                        ("OVERLAP", "overlap"))},
    **{f"TREEFLASH_{env}": _OPTION.format(opt, opt) for env, opt in (
        ("FUSED_TREE", "fused_tree"), ("TREE_INTO_VERIFY", "tree_into_verify"), ("FUSED_WALK", "fused_walk"),
        ("FUSED_TOPK", "fused_topk"))},
    "TREEFLASH_ADD_IN_NORM": _GONE.format(4),
    "TREEFLASH_FUSED_ROUTE": _GONE.format(3),
}


# Other programs' variables that slow every step when left set (debugging switches): name -> effect.
# TRITON_INTERPRET is this package's own choice on a machine without CUDA, so it counts only with one.
SLOW_FOREIGN = {
    "CUDA_LAUNCH_BLOCKING": "every CUDA launch waits for the GPU to finish (no host / device overlap)",
    "TRITON_INTERPRET": "every Triton kernel runs in the CPU interpreter, not on the GPU",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "torch's caching allocator is off (a cudaMalloc / cudaFree per tensor)",
}


def get(name: str) -> str | None:
    """The value of knob `name` (its default when unset or empty); ValueError for a value the
    knob does not accept. KeyError for a name that is not a knob (a bug in the caller)."""
    knob = KNOBS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return knob.default
    if knob.values is not None and raw not in knob.values:
        unset = "unset" if knob.default is None else f"default {knob.default}"
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(knob.values)} ({unset}); {knob.doc}")
    return raw


def _ints_error(knob: Knob, raw: str) -> str | None:
    try:
        vals = tuple(int(v) for v in raw.split(":"))
    except ValueError:
        vals = ()
    if len(vals) in knob.ints and min(vals) >= 1:
        return None
    return (f"{knob.name}={raw!r}: expected {' or '.join(map(str, knob.ints))} positive integers "
            f"separated by ':'; {knob.doc}")


def get_ints(name: str) -> tuple[int, ...] | None:
    """Knob `name` (one with `ints`) as its integers, None when unset; ValueError naming the format."""
    raw = get(name)
    if raw is None:
        return None
    err = _ints_error(KNOBS[name], raw)
    if err:
        raise ValueError(err)
    return tuple(int(v) for v in raw.split(":"))


def is_set(name: str, value: str) -> bool:
    """get(name) == value (e.g. is_set("TREEFLASH_W4A16_HUMMING", "0"): no humming copy)."""
    return get(name) == value


def shown(knob: Knob, value: str) -> str:
    return "<hidden>" if knob.secret else value


def switched(environ=None) -> dict[str, str]:
    """The switches set away from their defaults, {name: value}: what a benchmark result records
    beside its commit, so that an A/B run's figures cannot pass for the defaults'."""
    env = os.environ if environ is None else environ
    out = {}
    for name, knob in KNOBS.items():
        raw = env.get(name, "")
        if knob.switch and not knob.secret and raw != "" and raw != knob.default:
            out[name] = raw
    return out


def check_environment(environ=None, cuda: bool | None = None) -> tuple[list[str], list[str]]:
    """(notes, errors) about the process environment's TREEFLASH_* variables: a note for every
    switch set away from its default and every name that is not a knob (with the closest knob),
    an error for every value a knob does not accept and every variable no longer read (`MOVED`);
    and a note for each of SLOW_FOREIGN set to something other than 0 (TRITON_INTERPRET only where
    CUDA is available)."""
    env = os.environ if environ is None else environ
    notes, errors = [], []
    for name, effect in SLOW_FOREIGN.items():
        if env.get(name, "0") not in ("", "0"):
            if name == "TRITON_INTERPRET":
                if cuda is None:
                    import torch

                    cuda = torch.cuda.is_available()
                if not cuda:
                    continue
            notes.append(f"{name}={env[name]}: {effect}")
    for name in sorted(k for k in env if k.startswith(PREFIX)):
        raw = env[name]
        knob = KNOBS.get(name)
        if name in MOVED:
            errors.append(f"{name} is no longer read: {MOVED[name]}")
            continue
        if knob is None:
            near = difflib.get_close_matches(name, list(KNOBS), n=1)
            notes.append(f"{name} is not a treeflash variable (ignored)"
                         + (f"; did you mean {near[0]}?" if near else ""))
            continue
        if raw == "":
            continue
        if knob.values is not None and raw not in knob.values:
            errors.append(f"{name}={shown(knob, raw)!r}: expected one of {', '.join(knob.values)}")
        elif knob.ints and _ints_error(knob, raw):
            errors.append(_ints_error(knob, raw))
        elif knob.switch and raw != knob.default:
            default = "unset" if knob.default is None else knob.default
            notes.append(f"{name}={raw} (default {default}): {knob.doc}")
    return notes, errors
