#!/usr/bin/env bash
# Issue 9 in one device call on a multi-GPU kind (nvidia-h200-x2/-x4/-x8), N = every GPU there:
#   OUT=... bash benchmarks/gpu_multi.sh            (N=4 to use 4 of them)
# 1. `bench export` writes the kimi-k2 preset (64 heads, 48 of 384 experts, 4 of 61 layers,
#    random weights with the planted greedy chain) as checkpoints, so each rank loads its shards;
# 2. bench_tp.py: tokens of TP N and TP N x EP N equal to one GPU; batch 1 and 16 decode steps
#    with rank 0's all-reduce time and the MoE load per rank;
# 3. the sweep from 1k to 256k under --tp N (oracle acceptance, real prefill on every rank).
# Multicast stays off (device README): NCCL_NVLS_ENABLE=0 etc. are exported here for every child.
# Not run yet: no multi-GPU kind has been lent (2026-12-02). Rehearsed on the CPU with gloo:
#   python benchmarks/bench_tp.py --model X/target --drafter X/drafter --layouts 1x1,2x1,2x2 --device cpu
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:?set OUT}
N=${N:-$(nvidia-smi -L | wc -l)}
W=/tmp/multi; rm -rf "$W"; mkdir -p "$W" "$OUT"
pack() { tar -C "$W" --exclude k2 -czf "$OUT/multi.tar.gz" .; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$W/env.log" 2>&1
timeout 240 python3 -m treeflash.cli bench export --preset kimi-k2 --out "$W/k2" --device cuda --no-progress \
  2>&1 | tee "$W/export.log"
timeout 300 python3 benchmarks/bench_tp.py --model "$W/k2/target" --drafter "$W/k2/drafter" \
  --layouts "1x1,${N}x1,${N}x${N}" --device cuda --context 4096 --batch 16 --out "$W/tp.json" 2>&1 | tee "$W/tp.log"
pack
timeout 400 python3 -m treeflash.cli bench sweep --model "$W/k2/target" --drafter "$W/k2/drafter" \
  --acceptance oracle --tp "$N" --contexts 1k,8k,32k,64k,128k,185k,256k --spec off,ddtree --tree-budget 32 \
  --max-tokens 64 --device cuda --no-progress --out "$W/sweep-tp$N.json" --plot "$W/sweep-tp$N.png" \
  2>&1 | tee "$W/sweep.log"
pack
