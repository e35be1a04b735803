#!/usr/bin/env bash
# Issue 47 on a TP8 machine (nvidia-h100-x8 / nvidia-h200-x8), one device call:
#   OUT=... bash benchmarks/gpu_multi_dcp.sh          (N=4 for a 4-GPU kind: TP4 x DCP4)
# 1. `bench export` writes the kimi-k2 preset (64 heads, 48 of 384 experts, 4 of 61 layers, random
#    weights with the planted greedy chain) as checkpoints, its max_position_embeddings raised to 1M;
# 2. bench_dcp.py: TP N x DCP N against TP N alone on NCCL: the same greedy tokens (plain and DDTree),
#    the logits' max difference and argmax agreement (bf16), KV pages (a page id holds N x the tokens),
#    and plain decode ms a step at 128k after a real prefill;
# 3. `bench sweep --tp N` with --dcp 1 and --dcp N from 32k to 256k (a checkpoint's context comes
#    from a real prefill, quadratic in the context: 1M is left to gpu_dcp_model.sh's modelled rank),
#    plain and DDTree (oracle acceptance): per-step ms, rank 0's all-reduce time, the slope per +1k
#    context (expected: DCP N's ~1/N of DCP 1's, plus a fixed cost a step for the two DCP
#    collectives a layer: the queries' all-gather and the partials' all-to-all);
# 4. doctor --tp N --dcp N: kv_capacity (the longest request: N x one rank's).
# Multicast stays off (device README). Not run yet: no multi-GPU kind is lent (2026-12-07).
# Rehearsed on the CPU with gloo (2 ranks): python benchmarks/bench_dcp.py --model X --drafter D --tp 2
#   --dcp 1,2 --device cpu --dtype float32 --context 300 --page-size 4 --out /tmp/bd.json
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
OUT=${OUT:?set OUT}
N=${N:-$(nvidia-smi -L | wc -l)}
W=/tmp/multi-dcp; rm -rf "$W"; mkdir -p "$W" "$OUT"
pack() { tar -C "$W" --exclude k2 -czf "$OUT/multi-dcp.tar.gz" .; }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$W/env.log" 2>&1
timeout 240 python3 -m treeflash.cli bench export --preset kimi-k2 --out "$W/k2" --device cuda --no-progress \
  2>&1 | tee "$W/export.log"
python3 - "$W/k2/target/config.json" <<'PY'
import json, sys
p = sys.argv[1]; c = json.load(open(p)); c["max_position_embeddings"] = 1 << 20
json.dump(c, open(p, "w"), indent=1)
PY
timeout 400 python3 benchmarks/bench_dcp.py --model "$W/k2/target" --drafter "$W/k2/drafter" --tp "$N" \
  --dcp "1,$N" --context 131072 --out "$W/dcp.json" 2>&1 | tee "$W/dcp.log"
pack
sweep() {  # $1 = dcp size, $2 = contexts
  timeout 500 python3 -m treeflash.cli bench sweep --model "$W/k2/target" --drafter "$W/k2/drafter" \
    --acceptance oracle --tp "$N" --dcp "$1" --contexts "$2" --spec off,ddtree --tree-budget 15 \
    --max-tokens 48 --device cuda --no-progress --out "$W/sweep-tp$N-dcp$1.json" --plot "$W/sweep-tp$N-dcp$1.png" \
    2>&1 | tee "$W/sweep-dcp$1.log"
  pack
}
sweep 1 32k,64k,128k,256k
sweep "$N" 32k,64k,128k,256k
timeout 200 python3 -m treeflash.cli doctor --model "$W/k2/target" --drafter "$W/k2/drafter" --tp "$N" --dcp "$N" \
  --device cuda --context 128k 2>&1 | tee "$W/doctor-dcp$N.log"
pack
