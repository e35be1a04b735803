#!/usr/bin/env bash
# The W4A16 grouped MoE (kernels/moe_w4a16/: the portable Triton kernel, the Gluon MMA kernel,
# humming-kernels through the dispatch) on one GPU, ALL of it in ONE device call of <= 150 s:
#   1. installs the wheels carried in .whl/ (humming-kernels, compressed-tensors and its pydantic /
#      loguru / typing deps) into /tmp/site;
#   2. `treeflash bench moe` at Kimi K2 TP8 geometry, rows 1-1024, one CUDA graph of 16 calls
#      cycling 4 distinct weight sets (4.8 GB: nothing stays in L2), each variant checked against the
#      torch reference (NaN scales in the untouched experts) before and after its graph: the MMA
#      kernel in one process (~40 s), the portable kernel and humming in a second (~55 s; a kernel
#      that faults cannot take the others' figures with it; the second reuses the first's measured
#      ceilings), then --merge: one table with fractions of the floor (byte floor; matmul floor
#      beside it) and w4a16-dispatch.txt, the dispatch table's rows as measured (humming=True where
#      it won). A compile failure of the Gluon MMA kernel shows as "MMA kernel: FAILED" in
#      summary.txt with the error's first lines, and the other parts go on;
#   3. correctness on the GPU, compiled (TRITON_INTERPRET=0), in the time left:
#      tests/kernels/test_moe_w4a16.py (the portable and MMA kernels against compressed-tensors'
#      float64 loop: odd sizes, EP offsets, shared experts, split K, stats, determinism) and
#      test_moe_w4a16_humming.py (humming through the dispatch against the reference). pytest -v
#      prints each test's outcome and id as it finishes, so a run cut by its cap still names its
#      failures: summary.txt gets the counts, the FAILED / ERROR ids and the tests still running.
# Everything lands under $OUT: env.txt, pytest-gpu.log, bench-mma.log, bench-rest.log, moe-*.json,
# moe-merged.json, table.txt, w4a16-dispatch.txt, summary.txt.
#
# Device tool: carry [".whl"], command: OUT=$OUT bash benchmarks/gpu_w4a16.sh
# TESTS_ONLY=1 runs the compiled tests alone (no bench). (TREEFLASH_COMMIT=<sha> in front records the commit if the copy's .git is stale; BENCH_ARGS adds or
# overrides `bench moe` flags in both bench processes.)
set -uo pipefail
OUT=${OUT:-/tmp/w4a16-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
START=$(date +%s)
TOTAL=${TOTAL_S:-145}
log() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }  # min(wanted, time left), >= 5

if ls .whl/*.whl >/dev/null 2>&1; then
  log "installing $(ls .whl | wc -l) carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || log "wheel install FAILED (humming / compressed-tensors missing)"
fi
# /tmp/site after src/ but before site-packages: its typing_extensions (>= 4.14.1 for pydantic) wins
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import humming; print('humming', humming.__version__)" 2>&1 | tail -1
  which nvcc && nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${TESTS_ONLY:-0}" != 1 ]; then  # TESTS_ONLY=1: the compiled tests alone, with all the time
# 2. the bench: MMA alone, then portable + humming with the same ceilings, then the merged table
ROWS=1,2,4,8,16,32,64,128,512,1024
COMMON=(--rows "$ROWS" --layers 4 --calls 16 --replays 5 --out)
log "bench moe: mma ($(left) s left)"
TRITON_INTERPRET=0 timeout "$(cap 40)" python3 -m treeflash.cli bench moe --variants mma "${COMMON[@]}" "$OUT/moe-mma.json" \
  ${BENCH_ARGS:-} > "$OUT/bench-mma.log" 2>&1
RC=$?; echo "bench exit $RC" >> "$OUT/bench-mma.log"; log "bench mma exit $RC (124: cut at its time cap)"
MMA_BAD=$(grep -c "CHECK FAILED" "$OUT/bench-mma.log")
if [ ! -f "$OUT/moe-mma.json" ] || [ "$MMA_BAD" -gt 0 ]; then
  log "MMA kernel: FAILED on ${MMA_BAD} row counts (compile or check; the error text is in moe-mma.json / bench-mma.log)"
  grep -m1 -A3 -E "CompilationError|error:|Error" "$OUT/bench-mma.log" | tee -a "$OUT/summary.txt"
else
  log "MMA kernel: compiled and checked at every row count"
fi
CEIL=$(python3 -c "import json; c = json.load(open('$OUT/moe-mma.json'))['ceilings']; \
print(f\"--bandwidth {c['bytes_per_s']} --matmul {c['flops_per_s']}\")" 2>/dev/null)
log "bench moe: portable, humming ($(left) s left; ceilings ${CEIL:-measured again})"
TRITON_INTERPRET=0 timeout "$(cap 55)" python3 -m treeflash.cli bench moe --variants portable,humming $CEIL \
  "${COMMON[@]}" "$OUT/moe-rest.json" ${BENCH_ARGS:-} > "$OUT/bench-rest.log" 2>&1
RC=$?; echo "bench exit $RC" >> "$OUT/bench-rest.log"; log "bench portable, humming exit $RC"
grep -E "humming-kernels" "$OUT/bench-rest.log" | head -3 | tee -a "$OUT/summary.txt"

JSONS=$(ls "$OUT"/moe-mma.json "$OUT"/moe-rest.json 2>/dev/null)
if [ -n "$JSONS" ]; then
  python3 -m treeflash.cli bench moe --merge $JSONS > "$OUT/table.txt" 2>&1
  cat "$OUT/table.txt" | tee -a "$OUT/summary.txt"
else
  log "no bench JSON written"
fi
fi  # TESTS_ONLY
# 3. correctness, compiled, in the time left (the bench checked every variant at Kimi shapes already)
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # parallel compiles where pytest-xdist is
log "GPU tests (compiled${XDIST:+, 8 processes})"
TRITON_INTERPRET=0 timeout "$(cap ${TESTS_S:-60})" python3 -m pytest -v --tb=short -p no:cacheprovider -rs $XDIST \
  tests/kernels/test_moe_w4a16.py tests/kernels/test_moe_w4a16_humming.py > "$OUT/pytest-gpu.log" 2>&1
printf '\npytest exit %s\n' $? >> "$OUT/pytest-gpu.log"  # on a line of its own after a cut one
# "OUTCOME test-id" for each finished test, from either -v form: "[gw3] [ 40%] FAILED id" (xdist),
# "id FAILED [ 40%]" (one process); xdist also prints "id" alone when a test starts
finished() {
  sed -nE 's/^\[gw[0-9]+\] \[ *[0-9]+%\] ([A-Z]+) ([^ ]+::[^ ]+).*/\1 \2/p;
            s/^([^ []+::[^ ]+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS).*/\2 \1/p' "$OUT/pytest-gpu.log"
}
COUNTS=$(finished | cut -d' ' -f1 | sort | uniq -c | awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $1, tolower($2)}')
log "GPU tests: ${COUNTS:-no test finished}; $(tail -1 "$OUT/pytest-gpu.log")"
finished | grep -E "^(FAILED|ERROR) " | head -40 | tee -a "$OUT/summary.txt"
RUNNING=$(comm -23 <(sed -nE 's/^([^ []+::[^ ]+) $/\1/p' "$OUT/pytest-gpu.log" | sort -u) \
  <(finished | cut -d' ' -f2 | sort -u))
[ -n "$RUNNING" ] && { log "still running when pytest stopped:"; echo "$RUNNING" | head -10 | tee -a "$OUT/summary.txt"; }

log "done"
