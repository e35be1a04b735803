"""SASS fingerprints of the verify kernels for sm_90, without a GPU: proof that a refactor left
the machine code alone.

For every compile the dispatch table runs (`src/treeflash/kernels/mla_verify/__init__.py`): the
Hopper kernel over Q by TMA / registers x causal / tree x split / direct, the combine with and
without ALL_SPLITS at the tile shapes `combine.tiles` picks, and the portable and gathered
kernels at the tiles `TILES` runs (TMA and its pointer fallback, whole and gathered pages), the
SASS instruction lines (`cuobjdump -sass`, addresses and encodings dropped) are hashed:
sha256[:12] and the instruction count. Two checkouts with equal hashes run the same instructions
on the GPU, so a refactor that keeps them needs no device time to re-measure.

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src:benchmarks python benchmarks/sass_hashes.py \\
        --out new.json [--against base.json]

Run it under the Triton of the GPU (3.6, unpacked at /tmp/tri36; another version gives other
code). To fingerprint an older commit: `git archive REV src benchmarks | tar -x -C /tmp/base`,
copy this file over /tmp/base/benchmarks/sass_hashes.py and run the same command in /tmp/base
(its own `compile_v5` and `bench.kernel` then compile its kernels).
Trees from before the verify kernel became a package (5144cea and older: `mla_verify.py`,
`_v4.py`, `_v5.py`) are read under the same names: the Hopper kernel through that tree's
`compile_v5` with the staged store on (STAGE, its default), the portable kernels through its
`bench.kernel._report_source` by version (gathered = v2, portable = v3, portable_tree = v4),
the combine as `_mla_combine_kernel`. ~2-5 minutes on 2 cores.
`--against`: print SAME / DIFF per kernel and exit 1 if any kernel differs or is missing.
`--fp8`: also the compiles over fp8_e4m3 rows (`hopper_fp8.py` x Q by TMA / registers x causal /
tree x split / direct, the portable and gathered tiles with KV_FP8), named `*-fp8`; a base tree
without them compares only its own (run the proof of the 16-bit kernels without `--fp8`).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"

# (implementation, block_m, block_n, warps, stages, tma, page_size): the portable and gathered
# tiles the dispatch table runs on a GPU in 16-bit (`TILES`)
TILES = (
    ("gathered", 64, 64, 8, 2, False, 64), ("gathered", 64, 64, 8, 2, False, 1),
    ("portable", 16, 64, 8, 5, False, 64), ("portable", 16, 64, 8, 5, False, 1),
    ("portable", 64, 32, 8, 5, True, 64), ("portable", 64, 32, 8, 5, False, 64),
    ("portable_tree", 64, 64, 8, 4, True, 64), ("portable_tree", 64, 64, 8, 4, False, 64),
)
OLD_VERSION = {"gathered": 2, "portable": 3, "portable_tree": 4}  # trees up to 5144cea


def fingerprint(kernel) -> str:
    """'sha256[:12] (instructions)' of a compiled kernel's SASS instruction lines."""
    from compile_v5 import disassemble

    _, _, sass = disassemble(kernel, "sass-hash")
    lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    return f"{hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:12]} ({len(lines)})"


def _hopper(**kw):
    import compile_v5

    ok = inspect.signature(compile_v5.compile_v5).parameters
    if "stage" in ok:  # up to 5144cea: the staged store (the default) was the constexpr STAGE
        kw["stage"] = True
    if "fine" in ok:  # before 29133dd: the per-part ring was the constexpr FINE
        kw["fine"] = True
    return compile_v5.compile_v5(**{k: v for k, v in kw.items() if k in ok})


def _combine_fn():
    """The combine kernel of the tree on the path (a package since the refactor after 5144cea)."""
    from treeflash.kernels import mla_verify as mv

    if hasattr(mv, "_mla_combine_kernel"):
        return mv._mla_combine_kernel
    from treeflash.kernels.mla_verify import combine

    return combine._combine_kernel


def _combine(block_s: int, block_vc: int, warps: int, all_splits: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _combine_fn()
    sig = {"PO": "*bf16", "PLSE": "*fp32", "PL": "*i32", "O": "*bf16", "LSE": "*fp32"}
    sig.update({k: "i32" for k in "H N M v_dim num_splits s_ob s_on s_oh s_lb s_ln".split()})
    cx = {"BLOCK_S": block_s, "BLOCK_VC": block_vc, "BLOCK_N": 64, "ALL_SPLITS": all_splits}
    for p in fn.params:  # constexprs this tree adds (or had) at their defaults
        if p.is_constexpr and p.name not in cx:
            cx[p.name] = p.default
    sig.update({k: "constexpr" for k in cx})
    names = list(fn.arg_names)
    div16 = set("v_dim s_ob s_on s_oh".split())
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(ASTSource(fn=fn, signature={n: sig[n] for n in names}, constexprs=cx,
                                    attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _tiles(fp8: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:  # the compile report's own module since 2026-12-07; bench.kernel before
        from treeflash.bench import kernel_report as bk
    except ImportError:
        from treeflash.bench import kernel as bk

    old = isinstance(bk.REPORT_TILES[0][0], int)
    div16 = set("s_qb s_qn s_qh s_kp s_ks v_dim D chunk_max s_ob s_on s_oh".split())
    for impl, bm, bn, warps, stages, tma, page in TILES:
        kw = {"fp8": True} if fp8 else {}
        fn, sig, cx = bk._report_source(OLD_VERSION[impl] if old else impl, bm, bn, tma, page, **kw)
        names = list(sig)
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
                 if k not in cx and (sig[k].startswith("*") or k in div16)}
        yield (f"{impl}-{bm}x{bn}x{warps}x{stages}-t{int(tma)}-p{page}" + ("-fp8" if fp8 else ""),
               triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages}))


def compile_all(fp8: bool = False):
    """(name, compiled kernel) for every fingerprinted compile (`fp8`: the fp8_e4m3 ones too)."""
    for q in (True, False):
        for causal in (1, 0):
            for direct in (0, 1):
                yield (f"hopper-q{int(q)}-c{causal}d{direct}",
                       _hopper(is_causal=bool(causal), direct=bool(direct), q_tma=q))
    for a in (False, True):
        for bs, bvc, w in ((64, 64, 4), (256, 32, 4), (16, 128, 1)):
            yield f"combine-a{int(a)}-{bs}x{bvc}x{w}", _combine(bs, bvc, w, a)
    yield from _tiles()
    if fp8:
        import compile_v5

        for q in (True, False):
            for causal in (1, 0):
                for direct in (0, 1):
                    yield (f"hopper-q{int(q)}-c{causal}d{direct}-fp8",
                           compile_v5.compile_fp8(bool(causal), bool(direct), q_tma=q))
        yield from _tiles(fp8=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="write {kernel: fingerprint} here (JSON)")
    p.add_argument("--against", default="", help="a previous --out to compare with")
    p.add_argument("--fp8", action="store_true", help="also the compiles over fp8_e4m3 rows")
    args = p.parse_args(argv)
    out = {}
    for name, k in compile_all(args.fp8):
        out[name] = fingerprint(k)
        print(f"{name:32s} {out[name]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if not args.against:
        return 0
    with open(args.against) as f:
        base = json.load(f)
    bad = 0
    for name in sorted(set(out) | set(base)):
        same = out.get(name) == base.get(name)
        bad += not same
        print(f"{'SAME' if same else 'DIFF'} {name:32s} {base.get(name)} -> {out.get(name)}")
    print(f"{len(out)} kernels, {bad} differ" if bad else f"{len(out)} kernels, all the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
