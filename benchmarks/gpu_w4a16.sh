#!/usr/bin/env bash
# The W4A16 grouped MoE kernel (kernels/moe_w4a16.py) on one GPU, in ONE device call of <= 8 minutes:
#   1. installs the wheels carried in .whl/ (humming-kernels, compressed-tensors and its pydantic /
#      loguru / typing deps) into /tmp/site;
#   2. the kernel's tests compiled on the GPU (tests/kernels/test_moe_w4a16.py with
#      TRITON_INTERPRET=0: float64 oracle from compressed-tensors' unpacking, the torch twin, odd
#      sizes, EP offsets, shared experts, split K, stats, the router's route, NaN-scaled untouched
#      experts), 8 processes;
#   3. `treeflash bench moe` at Kimi K2 TP8 geometry, rows 1-1024: every variant checked against the
#      torch reference at bf16 tolerance (NaN scales in the untouched experts) before and after its
#      CUDA graph; bf16 (moe_gemm), W4A16 (defaults), humming-kernels, then a second pass over tile
#      configs and fixed splits (stopped by --budget-s).
# Everything lands under $OUT: env.txt, pytest-gpu.log, bench-moe.log, moe-*.json.
#
# Device tool: carry [".whl"], command: OUT=$OUT bash benchmarks/gpu_w4a16.sh
# (TREEFLASH_COMMIT=<sha> in front records the commit if the copy's .git is stale; BENCH_ARGS adds or
# overrides `bench moe` flags).
set -uo pipefail
OUT=${OUT:-/tmp/w4a16-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
START=$(date +%s)
log() { echo "[$(( $(date +%s) - START )) s] $*"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  log "installing $(ls .whl | wc -l) carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || log "wheel install FAILED (humming / compressed-tensors missing)"
fi
# /tmp/site after src/ but before site-packages: its typing_extensions (>= 4.14.1 for pydantic) wins
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -m pip list 2>/dev/null | grep -i -E "^(humming|compressed|pydantic|cuda-|tabulate|jinja2|filelock|typing)"
  which nvcc && nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # parallel compiles where pytest-xdist is
log "GPU tests (compiled${XDIST:+, 8 processes})"
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider $XDIST tests/kernels/test_moe_w4a16.py \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest-gpu.log"
tail -15 "$OUT/pytest-gpu.log"

# second-pass candidates (benchmarks/notes/moe-w4a16.md: what each tests, its sm_90 instruction count)
TILES="16:64:16:64:16:64:2:4:4@1-256"  # software-pipelined loads (cp.async), more bytes in flight
TILES="$TILES,16:128:16:128:16:64:1:8:8,16:64:16:128:16:64:1:4:8"  # 128 columns, 8 warps (both / down)
TILES="$TILES,16:64:32:64:32:64:1:4:4@1-256"  # 32-word K steps
TILES="$TILES,32:128:16:128:16:32:1:8:8@64-1024,32:64:16:64:16:32:1:4:4@128-1024"  # 32-row blocks
TILES="$TILES,64:128:16:128:16:32:1:8:8@256-1024"  # 64-row blocks
LEFT=$(( 460 - ($(date +%s) - START) ))
log "bench moe (${LEFT} s left)"
timeout $(( LEFT > 60 ? LEFT : 60 )) python3 -m treeflash.cli bench moe --out "$OUT" --budget-s $(( LEFT - 40 )) \
  --tiles "$TILES" --splits 1,2,4,8 --split-max-rows 16 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-moe.log"
log "done"
