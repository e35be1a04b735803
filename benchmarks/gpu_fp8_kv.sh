#!/usr/bin/env bash
# Issue 45 (the fp8_e4m3 KV cache, kvcache/format.py) on one H100 / H200, in ONE call of at most
# 200 s of wall time (LIMIT, default 195: every part runs under `timeout`, capped by what is left):
#   phase 1, in parallel (no timing in it):
#     a. correctness of the Hopper fp8 kernel (kernels/mla_verify/hopper_fp8.py): `bench kernel
#        --check --kv-dtype fp8 --check-only hopper` (bench/kernel_fp8.py: float64 reference on the
#        decoded rows, NaN-poisoned slots, trees, chains, batches, prefill chunks; its chain eager
#        against a CUDA graph, bitwise; the quantising writes against torch's casts);
#     b. the same for every other fp8 implementation (the table's choices, portable, portable_tree,
#        gathered page 1, fp16 / fp32 queries);
#     c. the accuracy table (benchmarks/fp8_kv_accuracy.py, float32 compute, 64 prompts x 128
#        tokens): the shipped pair and the random Kimi-geometry model, one process each.
#   If (a) fails, or hangs before its first case, every later fp8 figure runs
#   TREEFLASH_VERIFY_KERNEL=portable (logged); cut by its limit with every case so far ok, it stays.
#   phase 2: `bench kernel --kv-dtype bf16,fp8` on the idle GPU (61-call CUDA graph, page 64
#     contiguous): 185k, 64k, 256k, 128k x 8 / 64 / 128 heads x 1 / 16 / 64 rows, both caches of a
#     context back to back; bars: many-row shapes >= 0.8 of the fp8 floor (656 B a token) at >= 64k,
#     N = 1 at 185k >= 1.6x the bf16 cache.
#   phase 3: the kimi-k2-tp8 sweep (benchmarks/fp8_kv_sweep.py) at 128k, 256k (185k if time is
#     left), spec off and ddtree 31 under oracle acceptance, both caches side by side.
#   then benchmarks/fp8_kv_summary.py: each bar met or not, $OUT/summary.json, $OUT/accuracy.md.
# Everything lands under $OUT (default benchmarks/results/gpu-fp8-kv-<stamp>): JSON, logs.
#
#   Device tool: command `OUT=$OUT bash benchmarks/gpu_fp8_kv.sh` (no carry needed; the code runs
#   from src/ through PYTHONPATH, as gpu_w4a16.sh; TREEFLASH_COMMIT=<sha> in front records the commit).
#   SMOKE=1 DEVICE=cpu bash benchmarks/gpu_fp8_kv.sh   # the plumbing on a CPU: tiny shapes, the
#                                                      # kernel checks as their CPU tests
# Knobs: LIMIT [195], GRID_CONTEXTS [185k,64k,256k,128k], SWEEP_CONTEXTS [128k,256k,185k],
# SWEEP_TOKENS [32], ACC_ARGS [""] (extra fp8_kv_accuracy.py flags), PHASE1_S [80], GRID_S [50],
# COMPARE [0] (1: after the grid, N = 1 at 185k over fp8 rows, auto / hopper / portable, <= 30 s
# taken from the sweep's share).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
SMOKE=${SMOKE:-0}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-$([ "$SMOKE" = 1 ] && echo 900 || echo 195)}
OUT=${OUT:-benchmarks/results/gpu-fp8-kv-$(date +%Y%m%d-%H%M%S)}
GRID_CONTEXTS=${GRID_CONTEXTS:-185k,64k,256k,128k}
SWEEP_CONTEXTS=${SWEEP_CONTEXTS:-128k,256k,185k}
SWEEP_TOKENS=${SWEEP_TOKENS:-32}
ACC_ARGS=${ACC_ARGS:-}
COMPARE=${COMPARE:-0}
PHASE1_S=${PHASE1_S:-$([ "$SMOKE" = 1 ] && echo 600 || echo 80)}
GRID_S=${GRID_S:-50}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TREEFLASH_COMMIT=${TREEFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"; }
# within CAP CMD...: CMD under timeout, CAP seconds or what is left before LIMIT (less 8 s for the summary)
within() {
  local cap=$1 l; shift
  l=$(( $(left) - 8 ))
  [ "$cap" -lt "$l" ] && l=$cap
  if [ "$l" -lt 5 ]; then log "skipped, no time left: $*"; return 124; fi
  timeout -k 3 "$l" "$@"
}
{
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit $TREEFLASH_COMMIT, limit $LIMIT s, smoke $SMOKE"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
kernel() { within "$1" python3 -m treeflash.cli bench kernel --out "$OUT" "${@:2}"; }

# ---- phase 1: correctness (a, b) and accuracy (c), side by side --------------------------------
log "phase 1: fp8 checks and the accuracy table, in parallel"
if [ "$SMOKE" = 1 ]; then  # no CUDA: the same check functions on small cases under the interpreter
  within "$PHASE1_S" python3 -m pytest -q -p no:cacheprovider tests/bench/test_kernel_fp8.py \
    > "$OUT/check-fp8-cpu-tests.log" 2>&1 &
  ACC_ARGS="--prompts 2 --prompt-tokens 16 --tokens 4 $ACC_ARGS"
else
  kernel "$PHASE1_S" --tag check-hopper-fp8 --check --no-grid --kv-dtype fp8 --check-only hopper \
    > "$OUT/check-hopper-fp8.log" 2>&1 &
  kernel "$PHASE1_S" --tag check-fp8 --check --no-grid --kv-dtype fp8 --check-only None,3,portable \
    > "$OUT/check-fp8.log" 2>&1 &
fi
for model in shipped kimi_random; do
  within "$PHASE1_S" python3 benchmarks/fp8_kv_accuracy.py --device "$DEVICE" --models "$model" \
    --out "$OUT/accuracy-$model" $ACC_ARGS > "$OUT/accuracy-$model.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/check-*.log
tail -n 4 "$OUT"/accuracy-*.log
hopper="$OUT/check-hopper-fp8.log"
if [ "$SMOKE" != 1 ] && ! grep -q "check_fp8: all ok" "$hopper"; then
  if grep -q "^check BAD" "$hopper" || ! grep -q "^check ok" "$hopper"; then
    log "HOPPER FP8 FAILED OR HUNG: every later fp8 figure runs TREEFLASH_VERIFY_KERNEL=portable"
    export TREEFLASH_VERIFY_KERNEL=portable
  else  # cut by its time limit (compiles) with every case so far ok: the Hopper kernel stays
    log "hopper fp8 checks cut by the time limit after $(grep -c "^check ok" "$hopper") ok cases, none bad"
  fi
fi

# ---- phase 2: the kernel grid, both caches ---------------------------------------------------
if [ "$SMOKE" = 1 ]; then
  log "phase 2: the kernel grid needs CUDA (skipped)"
else
  log "phase 2: bench kernel --kv-dtype bf16,fp8 ($(left) s left)"
  kernel "$GRID_S" --tag grid-bf16-fp8 --kv-dtype bf16,fp8 --contexts "$GRID_CONTEXTS" --heads 8,64,128 \
    --nodes 1,16,64 --trees chain --modes contiguous --torch-max-gb 0 --reps 5 --graph-replays 2 \
    --budget-s $(( GRID_S - 20 )) 2>&1 | tee "$OUT/grid.log" | tail -n 45
  if [ "$COMPARE" = 1 ]; then  # plain decode over fp8 rows: the table's choice against each implementation
    log "phase 2b: N = 1 over fp8 rows, auto / hopper / portable ($(left) s left)"
    kernel 30 --tag compare-n1-fp8 --kv-dtype fp8 --compare auto,hopper,portable --contexts 185k \
      --heads 8,64 --nodes 1 --modes contiguous --reps 5 --graph-replays 2 > "$OUT/compare-n1-fp8.log" 2>&1
    tail -n 8 "$OUT/compare-n1-fp8.log"
  fi
fi

# ---- phase 3: the kimi sweep, both caches a context ------------------------------------------
if [ "$SMOKE" = 1 ]; then
  SWEEP=(--preset tiny --device cpu --dtype float32 --contexts 64,128 --tree-budget 3 --max-tokens 4)
else
  SWEEP=(--preset kimi-k2-tp8 --device cuda --contexts "$SWEEP_CONTEXTS" --tree-budget 31
         --max-tokens "$SWEEP_TOKENS" --cuda-graphs)
fi
budget=$(( $(left) - 45 ))
log "phase 3: the sweep, both caches ($(left) s left; no new context after $budget s)"
within 600 python3 benchmarks/fp8_kv_sweep.py "${SWEEP[@]}" --spec off,ddtree --budget-s "$(( budget > 1 ? budget : 1 ))" \
  --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
tail -n 12 "$OUT/sweep.log"

log "summary"
timeout 10 python3 benchmarks/fp8_kv_summary.py "$OUT" | tee "$OUT/summary.txt"
log "done: $OUT"
