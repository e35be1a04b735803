#!/usr/bin/env bash
# One H200: `bench sweep` on the kimi-k2-tp8 preset from 1k to 256k context, spec off / dflash /
# ddtree, with contiguous KV (page 64) and with the incident's layout (page 1, shuffled), so the
# cliff and its fix are both on record. Acceptance is declared (oracle: the target's own greedy
# continuation); per-layer times are extrapolated from 4 built layers to Kimi K2's 61.
# Writes JSON + PNG to $OUT (default benchmarks/results) and copies them to benchmarks/results.
# CUDA graphs replay the target forward (GRAPHS=0 for eager with the per-part breakdown); the
# replay's device time is what is extrapolated to 61 layers (see bench/sweep.py summarise).
#   LAYOUTS="contiguous scattered" CONTEXTS=1k,...,256k SCATTERED_CONTEXTS=1k,32k,185k MAX_TOKENS=160 \
#   GRAPHS=1 bash benchmarks/gpu_sweep.sh
# LAYOUTS may also name page1: page 1 in order (not shuffled), which the engine reads through
# 64-row coarse pages (kvcache.coarse), at PAGE1_CONTEXTS (default: SCATTERED_CONTEXTS).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
LAYOUTS=${LAYOUTS:-"contiguous scattered"}
CONTEXTS=${CONTEXTS:-1k,8k,32k,64k,128k,185k,256k}
SCATTERED_CONTEXTS=${SCATTERED_CONTEXTS:-1k,32k,185k}
MAX_TOKENS=${MAX_TOKENS:-160}
GRAPHS=${GRAPHS:-1}
BUDGET=${BUDGET:-31}
ACCEPT=${ACCEPT:-oracle}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
stamp=$(date +%Y%m%d-%H%M%S)
for layout in $LAYOUTS; do
  flags=(--page-size 64 --contexts "$CONTEXTS")
  [ "$layout" = scattered ] && flags=(--page-size 1 --scattered --contexts "$SCATTERED_CONTEXTS")
  [ "$layout" = page1 ] && flags=(--page-size 1 --contexts "${PAGE1_CONTEXTS:-$SCATTERED_CONTEXTS}")
  [ "$GRAPHS" = 1 ] && flags+=(--cuda-graphs)
  name="sweep-kimi-k2-tp8-$layout$([ "$GRAPHS" = 1 ] && echo -graphs || true)-$stamp"
  python -m treeflash.cli bench sweep --preset kimi-k2-tp8 --device cuda --dtype bfloat16 \
    --spec off,dflash,ddtree --tree-budget "$BUDGET" --max-tokens "$MAX_TOKENS" \
    --acceptance "$ACCEPT" "${flags[@]}" --no-progress \
    --out "$OUT/$name.json" --plot "$OUT/$name.png" 2>&1 | tee "$OUT/$name.log"
  [ "$OUT" != benchmarks/results ] && cp "$OUT/$name".{json,png,log} benchmarks/results/ || true
done
# The doctor at a long context, on both layouts (the scattered one must FAIL kv_fragmentation).
[ "${DOCTOR:-1}" = 1 ] || exit 0
python -m treeflash.cli doctor --preset kimi-k2-tp8 --device cuda --context 32k 2>&1 | tee "$OUT/doctor-contiguous-$stamp.log" || true
python -m treeflash.cli doctor --preset kimi-k2-tp8 --device cuda --context 32k --page-size 1 --scattered \
  2>&1 | tee "$OUT/doctor-scattered-$stamp.log" || true
