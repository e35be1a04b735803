#!/usr/bin/env bash
# One H100 / H200, one call (~8 minutes): the fp8_e4m3 KV cache (kvcache/format.py) on the GPU.
#   1. correctness (bench kernel --check --kv-dtype fp8, bench/kernel_fp8.py): every verify
#      implementation over fp8 rows against a float64 reference on the decoded cache, the Hopper
#      fp8 kernel (kernels/mla_verify/hopper_fp8.py) in a CUDA-graph chain (bitwise vs eager), the
#      quantising writes against their torch twins. The Hopper fp8 cases run first in their own
#      process under a timeout: if they fail or hang, every later fp8 figure is taken with
#      TREEFLASH_VERIFY_KERNEL=portable (the table without its Hopper rows) and the log says so.
#   2. the kernel grid, bf16 and fp8 caches side by side (61-call graph, contiguous page 64):
#      8 / 64 / 128 heads x 1 / 16 / 64 nodes at 185k, 64k, 128k (in that order: a cut keeps the
#      N = 1 bar's context); fraction of each one's floor
#      (fp8: 656 B a token) and fp8's speedup. Bars: >= 0.8 at >= 64k for the many-row shapes;
#      N = 1 at 185k >= 1.6x the bf16 cache.
#   3. plain decode's implementations over fp8 rows (the table's portable 16-row tile against
#      the Hopper fp8 kernel) at 8 and 64 heads, 64k / 185k: checks the table's M <= 16 row.
#   4. the kimi-k2-tp8 sweep at 128k / 185k / 256k, spec off and ddtree (oracle acceptance),
#      both caches side by side (benchmarks/fp8_kv_sweep.py).
# Everything lands under $OUT (default benchmarks/results/gpu-fp8-kv-<stamp>): JSON, logs.
#   bash benchmarks/gpu_fp8_kv.sh            # SKIP_SWEEP=1 / SKIP_COMPARE=1 drop a section
set -uo pipefail
cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
OUT=${OUT:-benchmarks/results/gpu-fp8-kv-$stamp}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
log() { echo "[$(elapsed) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt" || true
python - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))
EOF
kernel() { python -m treeflash.cli bench kernel --out "$OUT" "$@"; }

# 1. correctness: the Hopper fp8 kernel alone first (a hang or a failure must not take the rest)
log "check: hopper fp8"
timeout 240 python -m treeflash.cli bench kernel --out "$OUT" --tag check-hopper-fp8 --check --no-grid \
  --kv-dtype fp8 --check-only hopper 2>&1 | tee "$OUT/check-hopper-fp8.log"
if ! grep -q "check_fp8: all ok" "$OUT/check-hopper-fp8.log"; then
  log "HOPPER FP8 FAILED OR HUNG: every fp8 figure below runs TREEFLASH_VERIFY_KERNEL=portable"
  export TREEFLASH_VERIFY_KERNEL=portable
fi
log "check: the other fp8 cases and the writes"
timeout 240 python -m treeflash.cli bench kernel --out "$OUT" --tag check-fp8 --check --no-grid --kv-dtype fp8 \
  --check-only None,1,3,portable,gathered 2>&1 | tee "$OUT/check-fp8.log"

# 2. the grid, both caches (each context's bf16 and fp8 caches back to back)
log "grid: bf16,fp8"
timeout 240 python -m treeflash.cli bench kernel --out "$OUT" --tag grid-bf16-fp8 --kv-dtype bf16,fp8 \
  --contexts 185k,64k,128k --heads 8,64,128 --nodes 1,16,64 --trees chain --modes contiguous \
  --torch-max-gb 0 --reps 10 --graph-replays 3 --budget-s 200 2>&1 | tee "$OUT/grid.log"

# 3. plain decode over fp8 rows: the table's choice against each implementation
if [ "${SKIP_COMPARE:-0}" != 1 ]; then
  log "compare: N = 1 over fp8 rows"
  timeout 90 python -m treeflash.cli bench kernel --out "$OUT" --tag compare-n1-fp8 --kv-dtype fp8 \
    --compare auto,hopper,portable --contexts 64k,185k --heads 8,64 --nodes 1 --modes contiguous \
    --reps 10 --budget-s 75 2>&1 | tee "$OUT/compare-n1-fp8.log"
fi

# 4. the kimi-k2-tp8 sweep, both caches
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  left=$(( 520 - $(elapsed) ))
  log "sweep: auto,fp8_e4m3 ($left s left)"
  [ "$left" -gt 60 ] && timeout "$left" python benchmarks/fp8_kv_sweep.py --preset kimi-k2-tp8 --device cuda \
    --contexts 128k,185k,256k --spec off,ddtree --tree-budget 31 --max-tokens 96 --cuda-graphs \
    --out "$OUT" 2>&1 | tee "$OUT/sweep.log"
fi
log "done; files in $OUT"
ls -la "$OUT"
