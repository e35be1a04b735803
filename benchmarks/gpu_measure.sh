#!/usr/bin/env bash
# Second GPU pass (after benchmarks/gpu_first_contact.sh): lossless check in fp32, a profile of
# the eager step, and the issue-10 sweep with CUDA graphs on the planted-chain preset, in one
# device call; same stage/deadline/tarball mechanics as gpu_first_contact.sh.
#
#   OUT=/tmp/m DEADLINE=500 bash benchmarks/gpu_measure.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/stages.sh /tmp/measure measure.tar.gz

SW=(python3 -m treeflash.cli bench sweep --preset kimi-k2-tp8 --device cuda --dtype bfloat16
    --spec off,dflash,ddtree --tree-budget 32 --max-tokens 48 --no-progress)
# 1. lossless on the GPU: fp32, spec outputs must equal spec off token for token
stage embedded-fp32 70 python3 benchmarks/bench_embedded.py --device cuda --dtype float32 --budgets 16 \
  --max-tokens 64 --out "$W/embedded-fp32.json"
# 2. where an eager step's time goes
stage profile 100 python3 benchmarks/profile_step.py --out "$W"
# 3. issue 10/7: the sweep, contiguous pages, CUDA graphs (eager if capture fails)
stage sweep-contiguous-graphs 150 "${SW[@]}" --contexts 1k,8k,32k,64k,128k,185k,256k --page-size 64 \
  --cuda-graphs --out "$W/sweep-contiguous-graphs.json" --plot "$W/sweep-contiguous-graphs.png" \
|| stage sweep-contiguous-eager 120 "${SW[@]}" --contexts 1k,32k,128k,256k --page-size 64 \
  --out "$W/sweep-contiguous-eager.json" --plot "$W/sweep-contiguous-eager.png"
# 4. issue 7: budgets and auto, graphs on
stage e2e-step 110 python3 benchmarks/bench_e2e.py --device cuda --parts step --contexts 1024,32768,131072 \
  --budgets 8,16,32,64,auto --graphs on --tokens 48 --out "$W/e2e-step.json"
# 5. the incident's layout
stage sweep-scattered-graphs 80 "${SW[@]}" --contexts 1k,32k,185k --page-size 1 --scattered --cuda-graphs \
  --out "$W/sweep-scattered-graphs.json" --plot "$W/sweep-scattered-graphs.png"
# 6. the shipped pair (new drafter), graphs
stage embedded-graphs 60 python3 benchmarks/bench_embedded.py --device cuda --budgets 8,16,32,auto --graphs \
  --out "$W/embedded-graphs.json"
stage doctor-scattered 40 python3 -m treeflash.cli doctor --preset kimi-k2-tp8 --device cuda --context 32k \
  --page-size 1 --scattered
echo "done in $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.log"
