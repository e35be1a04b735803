#!/usr/bin/env bash
# Issue 41's sweep on one H100 / H200, in ONE device call of <= 7 minutes:
#  0. the W4A16 MoE kernel at the preset's geometry (384 experts, hidden 7168, inter 256, group 32),
#     checked on the GPU against the torch reference at 1 / 8 / 32 / 64 rows, and timed
#     (`bench moe`, no humming-kernels: gpu_w4a16.sh has that comparison);
#  1. `bench sweep` on kimi-k2.6-tp8 (Kimi K2.6's TP8 slice: INT4 routed experts, the K2.6 DFlash
#     drafter's geometry, 4 of 61 layers built and extrapolated, CUDA graphs) at 1k / 32k / 128k /
#     256k: spec off, dflash, ddtree (31 nodes) and auto, under declared acceptance 3 (the target's
#     own tokens for 3 depths, then wrong: about what K2.x drafters reach) and full (oracle);
#  2. the same on kimi-k2-tp8 (bf16 routed experts), for comparison;
#  3. both side by side (beside.md: each row's expert format, tok/s over all timed steps, ms a step,
#     floor, acceptance length, INT4 / bf16; beside.png), each acceptance's auto-against-the-rest
#     table, a check that every dflash / ddtree-31 row reached its declared acceptance, and the
#     memory plan of the whole K2.6 at TP 8 (this GPU, and an H200).
# Everything lands under $OUT: gpu.txt, 0-moe.{json,log}, 1-<preset>.{json,png,log}, 2-<bf16>.{json,png,log},
# 3-report.log, beside.md, beside.png, memory-plan.txt. Each part has its own time limit.
#
# Device tool: command `OUT=$OUT bash benchmarks/gpu_k26_sweep.sh` (TREEFLASH_COMMIT=<sha> in front records
# the commit where the copy's .git is stale). Knobs (defaults in brackets): CONTEXTS [1k,32k,128k,256k],
# TOKENS [64], ACCEPT [3,oracle], SPEC [off,dflash,ddtree], BUDGETS [31,auto], PARTS ["0 1 2 3"],
# PRESET [kimi-k2.6-tp8], BF16_PRESET [kimi-k2-tp8], DEVICE [cuda], DTYPE [bfloat16], SWEEP_LIMIT_S [170].
# A CPU smoke run of the plumbing (tests/bench/test_gpu_k26_sweep.py): DEVICE=cpu DTYPE=float32
# PRESET=tiny-int4 BF16_PRESET=tiny CONTEXTS=64 TOKENS=10 PARTS="1 2 3".
set -uo pipefail
cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
OUT=${OUT:-benchmarks/results/gpu-k26-sweep-$stamp}
CONTEXTS=${CONTEXTS:-1k,32k,128k,256k}
TOKENS=${TOKENS:-64}
ACCEPT=${ACCEPT:-3,oracle}
SPEC=${SPEC:-off,dflash,ddtree}
BUDGETS=${BUDGETS:-31,auto}
PARTS=${PARTS:-"0 1 2 3"}
PRESET=${PRESET:-kimi-k2.6-tp8}
BF16_PRESET=${BF16_PRESET:-kimi-k2-tp8}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SWEEP_LIMIT_S=${SWEEP_LIMIT_S:-170}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TREEFLASH_COMMIT=${TREEFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"; } \
  | tee "$OUT/gpu.txt"
say "commit $TREEFLASH_COMMIT, output in $OUT"

sweep() {  # $1: part number, $2: preset
  timeout "$SWEEP_LIMIT_S" python -m treeflash.cli bench sweep --preset "$2" --device "$DEVICE" --dtype "$DTYPE" \
    --cuda-graphs --spec "$SPEC" --tree-budget "$BUDGETS" --acceptance "$ACCEPT" --contexts "$CONTEXTS" \
    --max-tokens "$TOKENS" --no-progress --out "$OUT/$1-$2.json" --plot "$OUT/$1-$2.png" 2>&1 | tee "$OUT/$1-$2.log"
  return "${PIPESTATUS[0]}"
}

for part in $PARTS; do
  case $part in
  0)
    say "part 0: W4A16 MoE kernel at the preset's geometry, checked against the torch reference"
    timeout 60 python -m treeflash.cli bench moe --device "$DEVICE" --rows 1,8,32,64 --no-humming --layers 2 \
      --bf16-layers 1 --calls 4 --replays 3 --out "$OUT/0-moe.json" 2>&1 | tee "$OUT/0-moe.log"
    rc=${PIPESTATUS[0]}
    ;;
  1)
    say "part 1: $PRESET, contexts $CONTEXTS, spec $SPEC, budgets $BUDGETS, acceptance $ACCEPT, $TOKENS tokens"
    sweep 1 "$PRESET"; rc=$?
    ;;
  2)
    say "part 2: $BF16_PRESET (bf16 experts), the same runs"
    sweep 2 "$BF16_PRESET"; rc=$?
    ;;
  3)
    say "part 3: side by side, acceptance check, memory plan"
    OUT=$OUT PRESET=$PRESET BF16_PRESET=$BF16_PRESET timeout 60 python - <<'EOF' 2>&1 | tee "$OUT/3-report.log"
import json
import os
from pathlib import Path

from treeflash.bench import compare
from treeflash.bench.plot import plot_beside
from treeflash.bench.sweep_table import beside

out = Path(os.environ["OUT"])
paths = [out / f"1-{os.environ['PRESET']}.json", out / f"2-{os.environ['BF16_PRESET']}.json"]
results = [json.loads(p.read_text()) for p in paths if p.is_file()]
if not results:
    raise SystemExit("no sweep result to report")
text = beside(results)
(out / "beside.md").write_text(text + "\n")
print(text)
print(f"wrote {plot_beside(results, out / 'beside.png')}")
bad = []
for res in results:
    print(f"\n{res['preset']} ({res['expert_format']}): auto against off and the fixed budget")
    print(compare.table(compare.comparison(res)))
    block = res.get("drafter_block_size")  # full acceptance: the whole block a step
    for r in res["runs"]:
        if r.get("spec") not in ("dflash", "ddtree") or r.get("tree_budget") == "auto":
            continue
        declared = r["acceptance"]
        want = int(declared) + 1 if str(declared).isdigit() else None
        got = r["mean_acceptance_length"]
        line = f"  {res['preset']} {r['context']} {r['mode']}: acceptance length {got:.2f}"
        if want is not None and abs(got - want) > 0.05:
            bad.append(line + f" (declared {want})")
        elif want is None and block is not None and got < 0.95 * block:
            bad.append(line + f" (oracle: the block, {block})")
print("\nacceptance check: " + ("ok: every dflash / ddtree-31 row reached its declared acceptance" if not bad
                                else "MISMATCH\n" + "\n".join(bad)))
raise SystemExit(1 if bad else 0)
EOF
    rc=${PIPESTATUS[0]}
    { python -m treeflash.cli doctor --preset "$PRESET" --memory-plan --context 256k || true
      python -m treeflash.cli doctor --preset "$PRESET" --memory-plan --context 256k --gpu-memory h200 || true
    } 2>&1 | tee "$OUT/memory-plan.txt"
    ;;
  *) rc=2; echo "unknown part $part" ;;
  esac
  say "part $part done (exit $rc)"
done
say "all parts done; results in $OUT"
