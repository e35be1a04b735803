#!/usr/bin/env bash
# The whole engine on one GPU in one device call, most important first, each stage under its own
# timeout and all of them under one deadline (DEADLINE seconds, default 540), so a hang or a crash
# in one stage costs only that stage. Everything lands in $OUT/first-contact.tar.gz (re-packed
# after every stage, so a call cut short still returns what finished) plus $OUT/summary.log.
#
#   OUT=/tmp/fc DEADLINE=540 bash benchmarks/gpu_first_contact.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/stages.sh /tmp/first-contact first-contact.tar.gz
PROMPT='def quicksort(xs):'

# 1. the main job on the GPU: shipped pair, each spec mode (bf16)
for spec in off ddtree dflash; do
  stage "generate-$spec" 90 python3 -m treeflash.cli generate "$PROMPT" --device cuda --spec "$spec" \
    --max-tokens 64 --json
done
stage generate-ddtree-fp32 60 python3 -m treeflash.cli generate "$PROMPT" --device cuda --dtype float32 \
  --max-tokens 64 --json
# 2. issue 5/7: shipped pair decode speed, spec off vs chain vs trees (same prompts, greedy)
stage embedded-eager 120 python3 benchmarks/bench_embedded.py --device cuda --budgets 8,16,32,auto \
  --out "$W/embedded-eager.json"
# 3. issue 7: grouped MoE vs loop vs twin, and host syncs per spec step
stage e2e-moe-syncs 90 python3 benchmarks/bench_e2e.py --device cuda --parts moe,syncs --contexts 8192 \
  --out "$W/e2e-moe-syncs.json"
# 4. issue 10: the sweep on the TP8 slice of Kimi K2, contiguous pages, a short version
stage sweep-contiguous 150 python3 -m treeflash.cli bench sweep --preset kimi-k2-tp8 --device cuda \
  --dtype bfloat16 --contexts 1k,32k,128k,256k --spec off,dflash,ddtree --tree-budget 32 --max-tokens 48 \
  --page-size 64 --no-progress --out "$W/sweep-contiguous.json" --plot "$W/sweep-contiguous.png"
# 5. graphs on the shipped pair
stage embedded-graphs 90 python3 benchmarks/bench_embedded.py --device cuda --budgets 16,auto --graphs \
  --out "$W/embedded-graphs.json"
# 6. issue 8: NCCL at world size 1 through torchrun
stage torchrun-nccl-ws1 45 torchrun --standalone --nproc-per-node 1 -m treeflash.cli generate "$PROMPT" \
  --device cuda --max-tokens 32 --json
# 7. issue 10: doctor on the shipped pair and on the incident's layout
stage doctor-embedded 40 python3 -m treeflash.cli doctor --device cuda
stage doctor-scattered 40 python3 -m treeflash.cli doctor --preset kimi-k2-tp8 --device cuda --context 32k \
  --page-size 1 --scattered
echo "done in $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.log"
