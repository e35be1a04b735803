"""Compile the Hopper (Gluon) MLA verify kernel for sm_90 on a machine without a GPU and report
registers, spills, shared memory and the SASS counts (wgmma, waits, barriers, TMA, setmaxnreg).

Run under the Triton of the H200 (3.6), e.g. `TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src
python benchmarks/compile_v5.py` (a Triton 3.6 wheel unpacked at /tmp/tri36). The kernel code
does not depend on H or N (they are runtime arguments), only on the constexprs below, so one
compile covers every (H x N); the variants are causal / tree mask and direct / split output.
`--sass DIR` keeps the SASS and PTX for reading; VARIANTS below are the kernel with Q by TMA
and through registers, and the combine kernel (`compile_combine`). The kernel
(`src/treeflash/kernels/mla_verify/hopper.py`) was `mla_verify_v5.py` until 5144cea; the variants
removed since are in git there (the wgmma-layout output store, TRACE and EDGES) and at 4efd675.
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


# (name, Q_TMA): Q by TMA (q is one [B x N x H, D] row block), and through registers; the fp8
# kernel (`hopper_fp8.py`, fp8_e4m3 rows) the same two ways
VARIANTS = (("hopper", True), ("hopper-qreg", False), ("hopper_fp8", True), ("hopper_fp8-qreg", False))


def compile_v5(is_causal: bool, direct: bool, page: int = 64, dtype: str = "bf16",
               q_tma: bool = False):
    """The Hopper split kernel for sm_90 with these constexprs; arguments are placed by the
    kernel's own argument names."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from treeflash.kernels.mla_verify import hopper

    layout = hopper.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = f"tensordesc<{dtype}[{hopper.BLOCK_N}, {hopper.D_CHUNK}],{layout!r}>"
    sig = {"Q": f"*{dtype}", "kv_desc": desc, "q_desc": desc, "PT": "*i32", "PL": "*i32", "TM": "*u8",
           "O": f"*{dtype}", "LSE": "*fp32",
           "PO": f"*{dtype}", "PLSE": "*fp32", "qk_scale": "fp32"}
    ints = "H N M num_splits s_qb s_qn s_qh s_ptb s_tb s_tn s_ob s_on s_oh s_lb s_ln".split()
    sig.update({k: "i32" for k in ints})
    cx = {"PAGE_SIZE": page, "IS_CAUSAL": is_causal, "DIRECT": direct, "Q_TMA": q_tma}
    sig.update({k: "constexpr" for k in cx})
    names = list(hopper._hopper_kernel.arg_names)
    div16 = set("s_qb s_qn s_qh s_ob s_on s_oh".split())  # what the JIT marks at launch
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(GluonASTSource(fn=hopper._hopper_kernel, signature=sig, constexprs=cx,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": hopper.NUM_WARPS, "num_stages": 1})


def compile_fp8(is_causal: bool, direct: bool, page: int = 64, q_tma: bool = False):
    """The Hopper split kernel over fp8_e4m3 rows (`kernels/mla_verify/hopper_fp8.py`) for sm_90:
    q bf16, the cache's bytes (uint8), bf16 [64, 64] boxes over its rope bytes and over q."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from treeflash.kernels.mla_verify import hopper, hopper_fp8

    layout = hopper.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = f"tensordesc<bf16[{hopper.BLOCK_N}, {hopper.D_CHUNK}],{layout!r}>"
    sig = {"Q": "*bf16", "KV8": "*u8", "rope_desc": desc, "q_desc": desc, "PT": "*i32", "PL": "*i32",
           "TM": "*u8", "O": "*bf16", "LSE": "*fp32", "PO": "*bf16", "PLSE": "*fp32", "qk_scale": "fp32"}
    ints = "H N M num_splits s_qb s_qn s_qh s_ptb s_tb s_tn s_ob s_on s_oh s_lb s_ln".split()
    sig.update({k: "i32" for k in ints})
    cx = {"PAGE_SIZE": page, "IS_CAUSAL": is_causal, "DIRECT": direct, "Q_TMA": q_tma}
    sig.update({k: "constexpr" for k in cx})
    kernel = hopper_fp8._hopper_fp8_kernel
    names = list(kernel.arg_names)
    div16 = set("s_qb s_qn s_qh s_ob s_on s_oh".split())  # what the JIT marks at launch
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(GluonASTSource(fn=kernel, signature={k: sig[k] for k in names}, constexprs=cx,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": hopper.NUM_WARPS, "num_stages": 1})


def compile_combine(block_s: int = 64, block_vc: int = 64, all_splits: bool = True,
                    num_warps: int = 4):
    """The combine kernel (`kernels/mla_verify/combine.py`, bf16 partials) for sm_90 as launched
    after the Hopper kernel (64-key chunks, every split slot read: ALL_SPLITS; BLOCK_S 64 covers
    up to 64 splits)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeflash.kernels.mla_verify import combine

    sig = {"PO": "*bf16", "PLSE": "*fp32", "PL": "*i32", "O": "*bf16", "LSE": "*fp32"}
    sig.update({k: "i32" for k in "H N M v_dim num_splits s_ob s_on s_oh s_lb s_ln".split()})
    cx = {"BLOCK_S": block_s, "BLOCK_VC": block_vc, "BLOCK_N": 64, "ALL_SPLITS": all_splits}
    sig.update({k: "constexpr" for k in cx})
    names = list(sig)
    div16 = set("v_dim s_ob s_on s_oh".split())
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    return triton.compile(ASTSource(fn=combine._combine_kernel, signature=sig, constexprs=cx,
                                    attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),  # (backend, arch, warp size)
                          options={"num_warps": num_warps})


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
            "setmaxnreg": [x for x in lines if "USETMAXREG" in x],
            "LDL": count(r"\bLDL"), "STL": count(r"\bSTL")}


def report(args) -> list[dict]:
    import triton

    out = Path(args.sass) if args.sass else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    shapes = ((True, False), (False, False), (False, True))  # (causal, direct)
    jobs = list(itertools.product(VARIANTS, shapes))
    jobs.append((("combine", None), None))
    for (name, q_tma), shape in jobs:
        is_causal, direct = shape or (False, False)
        tag = name if shape is None else \
            f"{name}-{'causal' if is_causal else 'tree'}-{'direct' if direct else 'split'}"
        try:
            if shape is None:
                k = compile_combine()
            elif name.startswith("hopper_fp8"):
                k = compile_fp8(is_causal, direct, q_tma=q_tma)
            else:
                k = compile_v5(is_causal, direct, q_tma=q_tma)
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
        rows.append(row)
        print(f"report {tag}: " + ", ".join(f"{a}={b}" for a, b in row.items() if a != "tile"),
              flush=True)
    return rows



def disassemble(k, tag: str) -> tuple[int | None, int | None, str]:
    """(registers, stack bytes, SASS text) of a compiled kernel `k`, by the cuobjdump that ships
    with Triton (the cubin goes to /tmp/{tag}.cubin). Shared by sass_hashes.py."""
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
