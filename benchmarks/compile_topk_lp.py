"""Compile the tree build's top-k kernel (kernels/topk_lp.py) for sm_90 on a machine without a
GPU and report registers, spills (local-memory traffic), shared memory and instruction counts,
for the (V, k) the build launches.

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src python benchmarks/compile_topk_lp.py

(a Triton 3.6 wheel unpacked at /tmp/tri36, the H200's Triton). The code depends only on the
constexprs (padded V, padded k, warps), so one compile covers every row count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = ((4096, 1), (4096, 8), (4096, 16), (4096, 32), (4096, 64), (4096, 128), (1024, 128),
         (16384, 8), (16384, 32), (16384, 128))


def compile_topk(v: int, k: int, dtype: str = "fp32"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeflash.kernels import topk_lp

    bv, kb = max(16, triton.next_power_of_2(v)), triton.next_power_of_2(k)
    sig = {"X": f"*{dtype}", "O_LP": "*fp32", "O_TOK": "*i64", "V": "i32", "K": "i32", "s_row": "i32"}
    cx = {"BV": bv, "KB": kb, "LOG_V": bv.bit_length() - 1, "LOG_K": kb.bit_length() - 1}
    sig.update({n: "constexpr" for n in cx})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n].startswith("*")}
    return triton.compile(ASTSource(fn=topk_lp._topk_lp_kernel, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": topk_lp._num_warps(bv)}), topk_lp._num_warps(bv)


def main(argv: list[str] | None = None) -> int:
    import triton
    from compile_v5 import disassemble, sass_counts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for v, k in CASES:
        tag = f"topk_lp-v{v}-k{k}"
        try:
            kern, warps = compile_topk(v, k)
        except Exception as e:  # noqa: BLE001 - a failing compile is the result
            rows.append({"case": tag, "error": f"{type(e).__name__}: {str(e)[:3000]}"})
            print(f"{tag}: {rows[-1]['error']}", flush=True)
            continue
        regs, stack, sass = disassemble(kern, tag)
        counts = sass_counts(sass)
        rows.append({"case": tag, "triton": triton.__version__, "num_warps": warps, "registers": regs,
                     "stack_bytes": stack, "shared_bytes": kern.metadata.shared,
                     **{c: counts[c] for c in ("instructions", "BAR", "LDL", "STL")},
                     "SHFL": sass.count("SHFL.")})
        print(", ".join(f"{a}={b}" for a, b in rows[-1].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
