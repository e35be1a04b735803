"""Compile the v6 (Gluon, seesaw) MLA verify kernel for sm_90 on a machine without a GPU and
report registers, spills, shared memory and SASS counts; re-assemble each PTX with
`ptxas -arch=sm_90a -v` (spill bytes, C7515 warnings).

Run under the Triton of the H200 (3.6): `PYTHONPATH=/tmp/tri36:src python benchmarks/compile_v6.py
[--sass DIR] [--json FILE]`. One compile per constexpr set covers every (H x N) (runtime
arguments). Variants: causal / tree x split / direct x Q by TMA / Q by registers, + v5c's staged
store (tree, split) and PDL (tree, split). Also prints the per-partition hot-loop counts of WG0
and WG1 (SASS between the partitions' `USETMAXREG`) so the two warpgroups can be compared.
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

# (name, Q_TMA, STAGE, PDL)
VARIANTS = (("v6", True, False, False), ("v6-qreg", False, False, False))
EXTRA = (("v6-stage", True, True, False), ("v6-pdl", True, False, True))


def compile_v6(is_causal: bool, direct: bool, page: int = 64, dtype: str = "bf16",
               q_tma: bool = True, stage: bool = False, pdl: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from treeflash.kernels import mla_verify_v6 as v6

    layout = v6.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = f"tensordesc<{dtype}[{v6.BLOCK_N}, {v6.D_CHUNK}],{layout!r}>"
    sig = {"Q": f"*{dtype}", "kv_desc": desc, "q_desc": desc, "PT": "*i32", "PL": "*i32", "TM": "*u8",
           "O": f"*{dtype}", "LSE": "*fp32", "PO": f"*{dtype}", "PLSE": "*fp32", "qk_scale": "fp32"}
    ints = "H N M num_splits s_qb s_qn s_qh s_ptb s_tb s_tn s_ob s_on s_oh s_lb s_ln".split()
    sig.update({k: "i32" for k in ints})
    cx = {"PAGE_SIZE": page, "IS_CAUSAL": is_causal, "DIRECT": direct, "Q_TMA": q_tma,
          "STAGE": stage, "PDL": pdl}
    sig.update({k: "constexpr" for k in cx})
    names = list(sig)
    div16 = set("s_qb s_qn s_qh s_ob s_on s_oh".split())  # what the JIT marks at launch
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if k not in cx and (sig[k].startswith("*") or k in div16)}
    opts = {"num_warps": v6.NUM_WARPS, "num_stages": 1}
    if pdl:
        opts["launch_pdl"] = True
    return triton.compile(GluonASTSource(fn=v6._mla_split_kernel_v6, signature=sig, constexprs=cx,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def _lines(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)


def sass_counts(lines: list[str]) -> dict:
    count = lambda pat: sum(bool(re.search(pat, x)) for x in lines)  # noqa: E731
    return {"instructions": len(lines), "HGMMA": count(r"\bHGMMA"),
            "wgmma_waits": count(r"WARPGROUP\.DEPBAR"), "BAR": count(r"\bBAR\.(SYNC|ARV|RED)"),
            "TMA_loads": count(r"UTMALDG"), "mbarrier_waits": count(r"SYNCS\.PHASECHK"),
            "mbarrier_arrives": count(r"SYNCS\.ARRIVE"), "MUFU_EX2": count(r"MUFU\.EX2"),
            "LDL": count(r"\bLDL"), "STL": count(r"\bSTL")}


def ptxas_check(ptx: str, bindir: Path, tag: str) -> dict:
    """Re-assemble the PTX with ptxas -v for sm_90a: spill bytes and any warning (C7515)."""
    src = Path(f"/tmp/{tag}.ptx")
    src.write_text(ptx)
    r = sp.run([str(bindir / "ptxas"), "-arch=sm_90a", "-v", str(src), "-o", f"/tmp/{tag}.o"],
               capture_output=True, text=True)
    txt = r.stdout + r.stderr
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return {"ptxas_rc": r.returncode, "ptxas_warnings": [x for x in txt.splitlines() if "warning" in x],
            "spill_bytes": sum(int(a) + int(b) for a, b in spill),
            "ptxas_regs": [int(x) for x in re.findall(r"Used (\d+) registers", txt)]}


def report(args) -> list[dict]:
    import triton
    from compile_v5 import disassemble  # benchmarks/ is on sys.path when run as a script

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = Path(args.sass) if args.sass else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    shapes = ((True, False), (False, False), (False, True))  # (causal, direct)
    jobs = list(itertools.product(VARIANTS, shapes)) + [(e, (False, False)) for e in EXTRA]
    rows = []
    for (name, q_tma, stage, pdl), (is_causal, direct) in jobs:
        tag = f"{name}-{'causal' if is_causal else 'tree'}-{'direct' if direct else 'split'}"
        try:
            k = compile_v6(is_causal, direct, q_tma=q_tma, stage=stage, pdl=pdl)
        except Exception as e:  # noqa: BLE001 - a failing compile is the result
            rows.append({"tile": tag, "error": f"{type(e).__name__}: {str(e)[:4000]}"})
            print(f"report {tag}: {rows[-1]['error']}", flush=True)
            continue
        regs, stack, sass = disassemble(k, tag)
        if out:
            (out / f"{tag}.sass").write_text(sass)
            (out / f"{tag}.ptx").write_text(k.asm["ptx"])
            (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
        lines = _lines(sass)
        row = {"tile": tag, "triton": triton.__version__,
               "registers": regs, "stack_bytes": stack,
               "shared_bytes": k.metadata.shared, **sass_counts(lines),
               "setmaxnreg": [x.split()[-1] for x in lines if "USETMAXREG" in x],
               **ptxas_check(k.asm["ptx"], bindir, tag)}
        rows.append(row)
        print(f"report {tag}: " + ", ".join(f"{a}={b}" for a, b in row.items() if a != "tile"),
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", default="", help="folder for the SASS / PTX / TTGIR of each variant")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    rows = report(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ok = all("error" not in r and r["spill_bytes"] == 0 and not r["ptxas_warnings"]
             and r["shared_bytes"] <= 232448 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
