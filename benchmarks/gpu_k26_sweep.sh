#!/usr/bin/env bash
# Issue 41 items 5 / 6 on one H100 or H200, ALL of its GPU work in ONE device call of <= 200 s:
#  1. `bench sweep` on kimi-k2.6-tp8 (Kimi K2.6's TP8 slice: INT4 routed experts, the K2.6 DFlash
#     drafter's geometry, block 8; 4 of 61 layers built and extrapolated; CUDA graphs) at 1k / 32k /
#     128k / 256k: spec off, dflash, ddtree (31 nodes) and ddtree auto, under declared acceptance 3
#     (the target's own tokens for 3 depths, then wrong: about what K2.x drafters reach) and full
#     acceptance (oracle);
#  2. the same on kimi-k2-tp8 (bf16 routed experts, block 16), for comparison;
#  3. report.md (benchmarks/k26_report.py): both side by side (each row's expert format, tok/s over
#     all timed steps, ms a step, floor, acceptance length, INT4 / bf16), each acceptance's auto-
#     against-off-and-31 table, a check that every dflash / ddtree-31 run reached its declared
#     acceptance, and `doctor --memory-plan` of the whole K2.6 at TP 8 against an H100 and an H200
#     (+ this GPU's own total), each sweep's CUDA peak beyond weights and KV against the plan's
#     workspace + graphs estimate for its slice; beside.png.
# The repo runs from this copy (PYTHONPATH=src, as gpu_sweep.sh / gpu_spec_cost.sh; nothing to
# install: torch, triton and matplotlib are on the device); wheels carried in .whl/ (none needed
# here) go to /tmp/site as gpu_w4a16.sh does. Each part has its own time limit inside BUDGET_S;
# a sweep writes its JSON after each context, so one cut short keeps the contexts it finished.
# $OUT gets 7 files (the device returns at most 8): run.log (everything printed), report.md,
# beside.png, 1-<preset>.{json,png}, 2-<bf16 preset>.{json,png}.
#
# Device tool: command `OUT=$OUT bash benchmarks/gpu_k26_sweep.sh` (TREEFLASH_COMMIT=<sha> in front
# records the commit where the copy's .git is stale). Knobs (defaults in brackets): CONTEXTS
# [1k,32k,128k,256k], TOKENS [96], ACCEPT [3,oracle], SPEC [off,dflash,ddtree], BUDGETS [31,auto],
# PARTS ["1 2 3"], PRESET [kimi-k2.6-tp8], BF16_PRESET [kimi-k2-tp8], DEVICE [cuda], DTYPE
# [bfloat16], BUDGET_S [195]: the whole call's seconds, shared out as part 1 <= K26_S [100] (leaving
# part 2 >= BF16_S [50]), part 3 >= REPORT_S [20], part 2 the rest.
# CPU smoke run of the plumbing: DEVICE=cpu DTYPE=float32 PRESET=tiny-int4 BF16_PRESET=tiny
# CONTEXTS=64 TOKENS=10 BUDGET_S=600 K26_S=300 bash benchmarks/gpu_k26_sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUT=${OUT:-benchmarks/results/gpu-k26-sweep-$(date +%Y%m%d-%H%M%S)}
CONTEXTS=${CONTEXTS:-1k,32k,128k,256k}
TOKENS=${TOKENS:-96}
ACCEPT=${ACCEPT:-3,oracle}
SPEC=${SPEC:-off,dflash,ddtree}
BUDGETS=${BUDGETS:-31,auto}
PARTS=${PARTS:-"1 2 3"}
PRESET=${PRESET:-kimi-k2.6-tp8}
BF16_PRESET=${BF16_PRESET:-kimi-k2-tp8}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
BUDGET_S=${BUDGET_S:-195}
K26_S=${K26_S:-100}
BF16_S=${BF16_S:-50}
REPORT_S=${REPORT_S:-20}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TREEFLASH_COMMIT=${TREEFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }
atleast() { (( $1 > $2 )) && echo "$1" || echo "$2"; }  # a part always gets its floor of seconds
atmost() { (( $1 < $2 )) && echo "$1" || echo "$2"; }

sweep() {  # $1: part number, $2: preset, $3: seconds it may take
  say "part $1: $2, contexts $CONTEXTS, spec $SPEC, budgets $BUDGETS, acceptance $ACCEPT, $TOKENS tokens, ${3}s"
  timeout -k 5 "$3" python -m treeflash.cli bench sweep --preset "$2" --device "$DEVICE" --dtype "$DTYPE" \
    --cuda-graphs --spec "$SPEC" --tree-budget "$BUDGETS" --acceptance "$ACCEPT" --contexts "$CONTEXTS" \
    --max-tokens "$TOKENS" --no-progress --out "$OUT/$1-$2.json" --plot "$OUT/$1-$2.png"
}

run_all() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site" || say "wheel install FAILED"
  fi
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  say "commit $TREEFLASH_COMMIT, output in $OUT, ${BUDGET_S}s in all"
  local part rc
  for part in $PARTS; do
    case $part in
    1) sweep 1 "$PRESET" "$(atleast "$(atmost "$K26_S" $(( $(left) - BF16_S - REPORT_S )))" 30)" ;;
    2) sweep 2 "$BF16_PRESET" "$(atleast $(( $(left) - REPORT_S )) 30)" ;;
    3) say "part 3: side by side, auto's tables, acceptance check, memory plan"
       OUT=$OUT PRESET=$PRESET BF16_PRESET=$BF16_PRESET CONTEXT=${CONTEXTS##*,} \
         timeout -k 5 "$(atleast "$(left)" "$REPORT_S")" python benchmarks/k26_report.py ;;
    *) echo "unknown part $part"; false ;;
    esac
    rc=$?
    say "part $part done (exit $rc)"
  done
  say "all parts done; results in $OUT"
}

run_all 2>&1 | tee "$OUT/run.log"
