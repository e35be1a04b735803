"""SASS fingerprints of the verify kernels for sm_90, without a GPU: proof that a refactor left
the machine code alone.

For every kept compile of the verify path (the v5 split kernel over Q by TMA / registers x staged
store x causal / tree x split / direct, its TRACE and EDGES builds, the combine with and without
ALL_SPLITS at the tile shapes `_combine_tiles` picks, and the v2 / v3 / v4 tiles of the compile
report) the SASS instruction lines (`cuobjdump -sass`, addresses and encodings dropped) are
hashed: sha256[:12] and the instruction count. Two checkouts with equal hashes run the same
instructions on the H200, so a refactor that keeps them needs no device time to re-measure.

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src:benchmarks python benchmarks/sass_hashes.py \\
        --out new.json [--against base.json]

Run it under the Triton of the H200 (3.6, unpacked at /tmp/tri36; another version gives other
code). To fingerprint an older commit: `git archive REV src benchmarks | tar -x -C /tmp/base`,
then the same command with /tmp/base's src and benchmarks and this file. The v5 compiles go
through that tree's `compile_v5` (arguments it does not take are dropped, so trees from before
29133dd, whose compile_v5 still takes `fine`, are fingerprinted with fine=True); the combine
is compiled here, its other constexprs at their defaults. ~1.5 minutes on 2 cores.
`--against`: print SAME / DIFF per kernel and exit 1 if any kept kernel differs or is missing.
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


def fingerprint(kernel) -> str:
    """'sha256[:12] (instructions)' of a compiled kernel's SASS instruction lines."""
    from compile_v5 import disassemble

    _, _, sass = disassemble(kernel, "sass-hash")
    lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    return f"{hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:12]} ({len(lines)})"


def _v5(**kw):
    import compile_v5

    ok = inspect.signature(compile_v5.compile_v5).parameters
    if "fine" in ok:  # before 29133dd: the per-part ring was the constexpr FINE
        kw["fine"] = True
    return compile_v5.compile_v5(**{k: v for k, v in kw.items() if k in ok})


def _combine(block_s: int, block_vc: int, warps: int, all_splits: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeflash.kernels import mla_verify as mv

    fn = mv._mla_combine_kernel
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


def _report_tiles():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeflash.bench import kernel as bk

    div16 = set("s_qb s_qn s_qh s_kp s_ks v_dim D chunk_max s_ob s_on s_oh".split())
    for version, bm, bn, warps, stages, tma, page, *knobs in bk.REPORT_TILES:
        if knobs:  # (before 29133dd: v4 knob rows, removed since)
            continue
        fn, sig, cx = bk._report_source(version, bm, bn, tma, page)
        names = list(sig)
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
                 if k not in cx and (sig[k].startswith("*") or k in div16)}
        yield (f"v{version}-{bm}x{bn}x{warps}x{stages}-t{int(tma)}-p{page}",
               triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages}))


def compile_all():
    """(name, compiled kernel) for every fingerprinted compile."""
    for q in (True, False):
        for st in (True, False):
            for causal in (1, 0):
                for direct in (0, 1):
                    yield (f"v5-q{int(q)}s{int(st)}-c{causal}d{direct}",
                           _v5(is_causal=bool(causal), direct=bool(direct), q_tma=q, stage=st))
    yield "v5c-edges", _v5(is_causal=False, direct=False, q_tma=True, stage=True, edges=True)
    yield "v5c-trace", _v5(is_causal=False, direct=False, q_tma=True, stage=True, trace=True)
    for a in (False, True):
        for bs, bvc, w in ((64, 64, 4), (256, 32, 4), (16, 128, 1)):
            yield f"combine-a{int(a)}-{bs}x{bvc}x{w}", _combine(bs, bvc, w, a)
    yield from _report_tiles()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="write {kernel: fingerprint} here (JSON)")
    p.add_argument("--against", default="", help="a previous --out to compare with")
    args = p.parse_args(argv)
    out = {}
    for name, k in compile_all():
        out[name] = fingerprint(k)
        print(f"{name:28s} {out[name]}", flush=True)
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
        print(f"{'SAME' if same else 'DIFF'} {name:28s} {base.get(name)} -> {out.get(name)}")
    print(f"{len(out)} kernels, {bad} differ" if bad else f"{len(out)} kernels, all the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
