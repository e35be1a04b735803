"""Compile the v5 (Gluon) MLA verify kernel for sm_90 on a machine without a GPU and report
registers, spills, shared memory and the SASS counts (wgmma, waits, barriers, TMA, setmaxnreg).

Run under the Triton of the H200 (3.6), e.g. `TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src
python benchmarks/compile_v5.py` (a Triton 3.6 wheel unpacked at /tmp/tri36). The kernel code
does not depend on H or N (they are runtime arguments), only on the constexprs below, so one
compile covers every (H x N); the variants are causal / tree mask and direct / split output.
`--sass DIR` keeps the SASS and PTX for reading; VARIANTS below are v5, v5b and v5c;
LAZY_VARIANTS v5d (v5b + the lazy rescale).
PDL_VARIANTS (v5b / v5 with programmatic dependent launch, constexpr PDL + `launch_pdl`) and the
combine kernel with and without PDL (`compile_combine`) are compiled too: their rows carry the
griddepcontrol counts (SASS `ACQBULK` = wait, `PREEXIT` = launch_dependents) and `pdl_order`
(where the wait sits against the first global access and the worker partitions' start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess as sp
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")


# (name, FINE, Q_TMA, STAGE): v5 as measured on the H200, v5b (per-part ring barriers, Q by
# TMA), v5b's fallback for a q that is not one TMA row block (Q through registers, as v5), and
# v5c (v5b + the output halves stored through shared memory in 16-byte row stores)
VARIANTS = (("v5", False, False, False), ("v5b", True, True, False),
            ("v5b-qreg", True, False, False), ("v5c", True, True, True),
            ("v5c-qreg", True, False, True))
# v5d (v5b + the lazy rescale, constexpr LAZY; KERNEL_NOTES.md "v5d"): the same tuples compiled
# with LAZY=True (v5d-qreg: v5d's fallback for a q that is not one TMA row block)
LAZY_VARIANTS = (("v5d", True, True, False), ("v5d-qreg", True, False, False))
# the same tuples compiled with PDL=True and launch_pdl=True (KERNEL_NOTES.md "PDL for the verify call")
PDL_VARIANTS = (("v5b-pdl", True, True, False), ("v5b-qreg-pdl", True, False, False),
                ("v5-pdl", False, False, False))


def compile_v5(is_causal: bool, direct: bool, page: int = 64, dtype: str = "bf16",
               fine: bool = False, q_tma: bool = False, stage: bool = False, pdl: bool = False,
               lazy: bool = False, trace: bool = False, edges: bool = False,
               fuse: tuple[int, int, int] | None = None, pre: int | None = None,
               ahead: int = 0, sk: bool = False, tmpf: bool = False):
    """The v5 split kernel for sm_90 with these constexprs; `trace`: with TRACE and its int64
    buffer (benchmarks/trace_v5.py), `edges`: with EDGES and its buffer (benchmarks/edges_v5.py),
    `fuse`: v5e (FUSE, its grid-barrier workspace, merge tile (MSB, MCB, MTC)), `pre`: v5f (PRE
    with L2PF = pre, the cache pointer KVP, 576-element rows; compiled with launch_pdl), `ahead`:
    v5g (AHEAD = ahead, KVP, 576-element rows), `sk`: v5h (SK, stream-K);
    then arguments are placed by the kernel's own argument names."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from treeflash.kernels import mla_verify_v5 as v5

    layout = v5.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = f"tensordesc<{dtype}[{v5.BLOCK_N}, {v5.D_CHUNK}],{layout!r}>"
    sig = {"Q": f"*{dtype}", "kv_desc": desc, "q_desc": desc, "PT": "*i32", "PL": "*i32", "TM": "*u8",
           "O": f"*{dtype}", "LSE": "*fp32",
           "PO": f"*{dtype}", "PLSE": "*fp32", "qk_scale": "fp32"}
    ints = "H N M num_splits s_qb s_qn s_qh s_ptb s_tb s_tn s_ob s_on s_oh s_lb s_ln".split()
    sig.update({k: "i32" for k in ints})
    cx = {"PAGE_SIZE": page, "IS_CAUSAL": is_causal, "DIRECT": direct, "FINE": fine, "Q_TMA": q_tma,
          "STAGE": stage, "PDL": pdl}
    if lazy:  # only then: the other variants' constexprs exactly as before
        cx["LAZY"] = True
    if trace:
        cx["TRACE"] = True
    if edges:
        cx["EDGES"] = True
    if fuse:  # (MSB, MCB, MTC) of v5e's merge
        cx.update({"FUSE": True, "MSB": fuse[0], "MCB": fuse[1], "MTC": fuse[2]})
    if pre is not None:
        cx.update({"PRE": True, "L2PF": pre, "PF_ROW": 576})
    if ahead:
        cx.update({"AHEAD": ahead, "PF_ROW": 576})
    if sk:
        cx["SK"] = True
    if tmpf:
        cx["TMPF"] = True
    sig.update({k: "constexpr" for k in cx})
    if trace:
        sig["TR"] = "*i64"
    if edges:
        sig["ED"] = "*i64"
    if fuse:
        sig["WS"] = "*i32"
    if pre is not None or ahead:
        sig["KVP"] = f"*{dtype}"
    names = (list(v5._mla_split_kernel_v5.arg_names)
             if trace or edges or fuse or pre is not None or ahead or sk or tmpf else list(sig))
    div16 = set("s_qb s_qn s_qh s_ob s_on s_oh".split())  # what the JIT marks at launch
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(GluonASTSource(fn=v5._mla_split_kernel_v5, signature=sig, constexprs=cx,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": v5.NUM_WARPS, "num_stages": 1,
                                   "launch_pdl": pdl or pre is not None})


def compile_combine(pdl: bool = False, block_s: int = 64, block_vc: int = 64):
    """`_mla_combine_kernel` of mla_verify (bf16 partials) for sm_90 as launched after v5 (64-key
    chunks; BLOCK_S 64 covers up to 64 splits), with or without PDL."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeflash.kernels import mla_verify as mv

    sig = {"PO": "*bf16", "PLSE": "*fp32", "PL": "*i32", "O": "*bf16", "LSE": "*fp32"}
    sig.update({k: "i32" for k in "H N M v_dim num_splits s_ob s_on s_oh s_lb s_ln".split()})
    cx = {"BLOCK_S": block_s, "BLOCK_VC": block_vc, "BLOCK_N": 64, "PDL": pdl}
    sig.update({k: "constexpr" for k in cx})
    names = list(sig)
    div16 = set("v_dim s_ob s_on s_oh".split())
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(ASTSource(fn=mv._mla_combine_kernel, signature=sig, constexprs=cx,
                                    attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),  # (backend, arch, warp size)
                          options={"num_warps": 4, "launch_pdl": pdl})


def pdl_order(ptx: str) -> dict:
    """Where `griddepcontrol.wait` sits in the PTX: its line, the first global access (ld.global,
    a TMA copy, cp.async) and the first `barrier.sync 1` (the default partition releasing the
    warp-specialised workers; absent in a plain kernel). Intended: wait < both."""
    lines = ptx.splitlines()

    def first(pat):
        return next((i for i, x in enumerate(lines) if re.search(pat, x)), None)

    return {"wait_line": first(r"griddepcontrol\.wait"),
            "launch_dependents_line": first(r"griddepcontrol\.launch_dependents"),
            "first_global_line": first(r"ld\.global|cp\.async\.bulk\.tensor|cp\.async\.ca|cp\.async\.cg"),
            "workers_start_line": first(r"barrier\.sync\s+1;")}


def sass_counts(sass: str) -> dict:
    """Whole-kernel SASS counts: MMA, wgmma waits (`WARPGROUP.DEPBAR`), CTA / named barriers,
    TMA loads, mbarrier waits (`SYNCS.PHASECHK`), register budget changes (`USETMAXREG`),
    local-memory (spill) traffic."""
    lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    count = lambda pat: sum(bool(re.search(pat, x)) for x in lines)  # noqa: E731
    return {"instructions": len(lines), "HGMMA": count(r"\bHGMMA"),
            "wgmma_waits": count(r"WARPGROUP\.DEPBAR"), "warpgroup_arrive": count(r"WARPGROUP\.ARRIVE"),
            "BAR": count(r"\bBAR\.(SYNC|ARV|RED)"), "TMA_loads": count(r"UTMALDG"),
            "mbarrier_waits": count(r"SYNCS\.PHASECHK"), "mbarrier_arrives": count(r"SYNCS\.ARRIVE"),
            "gdc_wait": count(r"\bACQBULK\b"), "gdc_launch_dependents": count(r"\bPREEXIT\b"),
            "setmaxnreg": [x for x in lines if "USETMAXREG" in x],
            "LDL": count(r"\bLDL"), "STL": count(r"\bSTL")}


def report(args) -> list[dict]:
    import triton

    out = Path(args.sass) if args.sass else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    shapes = ((True, False), (False, False), (False, True))  # (causal, direct)
    jobs = [(v, s, False) for v, s in itertools.product(VARIANTS + LAZY_VARIANTS, shapes)]
    jobs += [(v, s, True) for v, s in itertools.product(PDL_VARIANTS, shapes[1:])]
    jobs += [(("combine-pdl" if p else "combine", None, None, None), None, p) for p in (False, True)]
    for (name, fine, q_tma, stage), shape, pdl in jobs:
        is_causal, direct = shape or (False, False)
        tag = name if shape is None else \
            f"{name}-{'causal' if is_causal else 'tree'}-{'direct' if direct else 'split'}"
        try:
            if shape is None:
                k = compile_combine(pdl=pdl)
            else:
                k = compile_v5(is_causal, direct, fine=fine, q_tma=q_tma, stage=stage, pdl=pdl,
                               lazy=name.startswith("v5d"))
        except Exception as e:  # noqa: BLE001 - a failing compile is the result
            rows.append({"tile": tag, "error": f"{type(e).__name__}: {str(e)[:3000]}"})
            print(f"report {tag}: {rows[-1]['error']}", flush=True)
            continue
        regs, stack, sass = disassemble(k, tag)
        if out:
            (out / f"{tag}.sass").write_text(sass)
            (out / f"{tag}.ptx").write_text(k.asm["ptx"])
            (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
        row = {"tile": tag, "triton": triton.__version__, "registers": regs, "stack_bytes": stack,
               "shared_bytes": k.metadata.shared, **sass_counts(sass)}
        if pdl:
            row["launch_pdl"] = bool(k.metadata.launch_pdl)
            row["pdl_order"] = pdl_order(k.asm["ptx"])
        rows.append(row)
        print(f"report {tag}: " + ", ".join(f"{a}={b}" for a, b in row.items() if a != "tile"),
              flush=True)
    return rows



def disassemble(k, tag: str) -> tuple[int | None, int | None, str]:
    """(registers, stack bytes, SASS text) of a compiled kernel `k`, by the cuobjdump that ships
    with Triton (the cubin goes to /tmp/{tag}.cubin). Shared by compile_v6, trace_v5, probe_fill."""
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(f"/tmp/{tag}.cubin")
    cubin.write_bytes(k.asm["cubin"])
    res = sp.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                 text=True).stdout
    sass = sp.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return (int(reg.group(1)) if reg else None), (int(reg.group(2)) if reg else None), sass

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", default="", help="folder for the SASS / PTX / TTGIR of each variant")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    rows = report(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
