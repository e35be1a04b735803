"""Compile the W4A16 MoE kernels (`kernels/moe_w4a16.py`) for sm_90 on a machine without a GPU and
report what the code became: registers, stack (spills), shared memory, and the hot loop's
instructions by kind, per weight unpacked.

    TRITON_INTERPRET=0 python benchmarks/compile_w4a16.py [--tiles SPEC,...] [--out DIR]

Rows: gate_up (routed INT4 blocks + the shared expert's bf16 blocks in one kernel, split or not)
and down, at Kimi K2 TP8 strides, per x dtype and words a scale group. The hot loop is the
backward-branch loop with the most LOP3 (the unpack); "per weight" divides its thread-instructions
by the weights one trip unpacks (BLOCK_N x BKW x 8 x matrices / threads). Run it under the Triton
version of the GPU (3.6 on the H100 / H200 image: `pip install --target DIR triton==3.6.0` and put
DIR first on PYTHONPATH): the generated code differs between versions (3.9 and 3.6 differ by up
to 1.6x in instructions a weight for the same source).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess as sp
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from treeflash.kernels import moe_w4a16 as mw  # noqa: E402

KINDS = {"LDG": r"\bLDG", "LDS": r"\bLDS\b|\bLDS\.", "LDSM": r"\bLDSM", "STS": r"\bSTS", "LDGSTS": r"LDGSTS",
         "HMMA": r"\bHMMA", "HGMMA": r"HGMMA", "FFMA": r"\bFFMA", "FADD": r"\bFADD", "FMUL": r"\bFMUL",
         "HFMA2": r"\bHFMA2", "HMUL2": r"\bHMUL2",
         "LOP3": r"\bLOP3", "SHF": r"\bSHF", "F2F": r"\bF2F|F2FP", "I2F": r"\bI2F", "BAR": r"BAR\.SYNC",
         "SHFL": r"SHFL", "PRMT": r"\bPRMT", "IMAD": r"\bIMAD", "LDL": r"\bLDL", "STL": r"\bSTL"}


def _sig(kernel: str, split: int, dt: str = "bf16") -> tuple[dict, set]:
    """(signature, names of 16-divisible ints) of one kernel, pointers as at Kimi K2 TP8 (x in dt)."""
    if kernel == "gate_up":
        sig = {"X": f"*{dt}", "WG": "*i32", "WU": "*i32", "SG": "*bf16", "SU": "*bf16", "HOUT": f"*{dt}",
               "ORDER": "*i32", "BLK_E": "*i32", "BLK_R0": "*i32", "BLK_R1": "*i32"}
        ints = ("INTER TOPK HW s_xt s_we s_wn s_se s_sn s_ht kw_chunk s_ps s_pr").split()
        sig.update({k: "i32" for k in ints[:9]})
        sig.update(PART="*fp32", CNT="*i32", kw_chunk="i32", s_ps="i32", s_pr="i32", WSG=f"*{dt}", WSU=f"*{dt}")
        sig.update({k: "i32" for k in "NB T A S_CH s_swe s_swn MAGIC MAGIC2".split()})
        div = set("INTER HW s_xt s_we s_wn s_se s_sn s_ht kw_chunk s_ps s_pr s_swe s_swn".split())
    else:
        sig = {"HIN": f"*{dt}", "WD": "*i32", "SD": "*bf16", "Y": "*fp32", "ORDER": "*i32", "WEIGHT": "*fp32",
               "BLK_E": "*i32", "BLK_R0": "*i32", "BLK_R1": "*i32"}
        sig.update({k: "i32" for k in "HID INTER IW s_ht s_we s_wn s_se s_sn s_yt".split()})
        sig["WSD"] = f"*{dt}"
        sig.update({k: "i32" for k in "NB T A TOPK S_CH s_swe s_swn MAGIC MAGIC2".split()})
        div = set("HID INTER IW s_ht s_we s_wn s_se s_sn s_yt s_swe s_swn".split())
    return sig, div


def _hot(sass: str) -> list[str]:
    """The backward-branch loop body with the most LOP3 (the unpack)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in where:
            continue
        body = [x for _, x in ins[where[int(m.group(1), 16)]:i + 1]]
        if sum("LOP3" in x for x in body) > sum("LOP3" in x for x in best):
            best = body
    return best


ASM = True


def compile_one(kernel: str, tiles: mw.Tiles, split: int, out: Path, dt: str = "bf16", gw: int = 4) -> dict:
    sig, div = _sig(kernel, split, dt)
    gu = kernel == "gate_up"
    cx = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_n if gu else tiles.down_n, BKW=tiles.gu_kw if gu else
              tiles.down_kw, BK_SH=tiles.shared_k, SH_M=mw.SHARED_M, GW=gw, PRESCALE=dt != "fp16",
              ASM=ASM and dt != "fp32", DOT_PREC="ieee" if dt == "fp32" else "tf32", DOT_F32=False)
    if gu:
        cx["SPLIT_K"] = split
    sig.update({k: "constexpr" for k in cx})
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if k not in cx and (sig[k].startswith("*") or k in div)}
    warps = tiles.gu_warps if gu else tiles.down_warps
    fn = mw._gate_up_kernel if gu else mw._down_kernel
    tag = f"{kernel}-{tiles.spec()}-s{split}{'' if dt == 'bf16' else '-' + dt}{'' if gw == 4 else f'-gw{gw}'}"
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": tiles.stages})
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
        return {"tile": tag, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = out / f"{tag}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    res = sp.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    sass = sp.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    (out / f"{tag}.sass").write_text(sass)
    cubin.unlink()
    reg = re.search(r"REG:(\d+) STACK:(\d+)", res)
    body = _hot(sass)
    counts = {name: sum(bool(re.search(pat, x)) for x in body) for name, pat in KINDS.items()}
    n = tiles.gu_n if gu else tiles.down_n
    kw = tiles.gu_kw if gu else tiles.down_kw
    weights_per_thread = n * kw * 8 * (2 if gu else 1) / (32 * warps)
    return {"tile": tag, "registers": int(reg.group(1)) if reg else None, "stack": int(reg.group(2)) if reg else None,
            "shared": k.metadata.shared, "hot_loop": len(body), "per_weight": len(body) / weights_per_thread,
            **counts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", default=",".join(t.spec() for t in (mw.SMALL_TILES, mw.LARGE_TILES)))
    p.add_argument("--splits", default="1,4")
    p.add_argument("--no-asm", action="store_true", help="the Triton-ops unpack (as in the interpreter)")
    p.add_argument("--dtypes", default="bf16", help="x dtypes: bf16, fp16, fp32 (comma-separated)")
    p.add_argument("--gws", default="4", help="packed words a scale group (group size / 8), comma-separated")
    p.add_argument("--out", default="/tmp/compile_w4a16")
    args = p.parse_args(argv)
    global ASM
    ASM = not args.no_asm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"triton {triton.__version__}, sm_90")
    runs = [(spec, dt, int(gw)) for spec in args.tiles.split(",") for dt in args.dtypes.split(",")
            for gw in args.gws.split(",")]
    for spec, dt, gw in runs:
        tiles = mw.Tiles.parse([int(v) for v in spec.split(":")])
        for kernel, split in [("gate_up", int(s)) for s in args.splits.split(",")] + [("down", 1)]:
            row = compile_one(kernel, tiles, split, out, dt, gw)
            rows.append(row)
            if "error" in row:
                print(f"{row['tile']}: {row['error']}")
                continue
            print(f"{row['tile']:44s} regs {row['registers']:3d} stack {row['stack']:4d} smem {row['shared']:6d} | "
                  f"loop {row['hot_loop']:4d} instr, {row['per_weight']:.2f}/weight: "
                  + " ".join(f"{k} {row[k]}" for k in KINDS if row[k]), flush=True)
    (out / "compile_w4a16.json").write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
