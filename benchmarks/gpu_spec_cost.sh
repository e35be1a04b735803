#!/usr/bin/env bash
# Issue 42 on one H100 / H200, in one call (<= ~9 minutes): speculation that always pays.
#  0. lossless on the GPU: the shipped pair in float32, auto against spec off, greedy tokens equal;
#  1. kimi-k2-tp8 (bf16 experts, CUDA graphs, 4 of 61 layers extrapolated): the budget table under
#     declared acceptance 0 / 1 / 3 / oracle at each context, spec off, fixed budgets and auto
#     (bars: auto >= 0.97 x the best of off and every fixed budget; at acceptance 0 >= 0.95 x off);
#  2. the shipped pair with its real drafter at 1k and near the longest context it allows, fixed
#     budgets and auto (bar: auto >= 1.05 x the best fixed budget);
#  3. serving throughput, shipped pair: concurrency 1 / 8 / 32 / 64, spec off / fixed / auto
#     (bar: auto >= 0.97 x the best of the others at each concurrency);
#  4. doctor on kimi-k2-tp8 at 32k, its tree_sizing explained at batch 32.
# If a part runs out of its time limit, trim its knobs (e.g. KIMI_CONTEXTS=1k,128k, KIMI_TOKENS=64).
# Every part prints progress and writes JSON (+ logs) under $OUT (default benchmarks/results/
# gpu-spec-cost-<stamp>); each part has its own time limit, so one slow part cannot sink the rest.
#   OUT=/tmp/out bash benchmarks/gpu_spec_cost.sh
# Knobs (defaults in brackets): KIMI_CONTEXTS [1k,32k,128k,256k], KIMI_BUDGETS [1,3,7,15,31,auto],
# ACCEPT [0,1,3,oracle], KIMI_TOKENS [96], PAIR_CONTEXTS [1k,30k], PAIR_TOKENS [256],
# SERVE_TOKENS [96], SERVE_CONCURRENCY [1,8,32,64], PARTS ["0 1 2 3 4"]; DEVICE [cuda], PRESET
# [kimi-k2-tp8], DTYPE [bfloat16] (a CPU smoke run of the plumbing: DEVICE=cpu PRESET=tiny
# DTYPE=float32 KIMI_CONTEXTS=128 PAIR_CONTEXTS=256 SERVE_CONCURRENCY=1,2 ... tokens small).
set -uo pipefail
cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
OUT=${OUT:-benchmarks/results/gpu-spec-cost-$stamp}
KIMI_CONTEXTS=${KIMI_CONTEXTS:-1k,32k,128k,256k}
KIMI_BUDGETS=${KIMI_BUDGETS:-1,3,7,15,31,auto}
ACCEPT=${ACCEPT:-0,1,3,oracle}
KIMI_TOKENS=${KIMI_TOKENS:-96}
PAIR_CONTEXTS=${PAIR_CONTEXTS:-1k,30k}
PAIR_TOKENS=${PAIR_TOKENS:-256}
SERVE_TOKENS=${SERVE_TOKENS:-96}
SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-1,8,32,64}
PARTS=${PARTS:-"0 1 2 3 4"}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-kimi-k2-tp8}
DTYPE=${DTYPE:-bfloat16}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TREEFLASH_COMMIT=${TREEFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
say "commit $TREEFLASH_COMMIT, output in $OUT"

for part in $PARTS; do
  case $part in
  0)
    say "part 0: lossless on the GPU (shipped pair, float32, auto vs off, greedy)"
    DEVICE=$DEVICE timeout 120 python - <<'EOF' 2>&1 | tee "$OUT/0-lossless.log"
import json
import os
from treeflash import LLM, SamplingParams
from treeflash.engine.llm import EMBEDDED
texts = [p["text"] for p in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]][:4]
params = SamplingParams(max_tokens=64, ignore_eos=True)
off = LLM(spec="off", device=os.environ["DEVICE"], dtype="float32")
want = [o.token_ids for o in off.generate(texts, params)]
auto = LLM(tree_budget="auto", device=os.environ["DEVICE"], dtype="float32")
auto.warmup(max_tokens=16)
outs = auto.generate(texts, params)
same = [o.token_ids == w for o, w in zip(outs, want)]
for o in outs:
    m = o.metrics["speculative_decoding"]
    print("steps by budget", m["steps_by_budget"], "plain", m["num_plain_steps"],
          "acceptance length", round(m["mean_acceptance_length"] or 1.0, 2), "invariants",
          m.get("invariant_error", "ok"))
print(f"lossless (float32, greedy, auto vs off): {sum(same)}/{len(same)} requests token-identical")
raise SystemExit(0 if all(same) else 1)
EOF
    rc=${PIPESTATUS[0]}
    ;;
  1)
    say "part 1: $PRESET budget table, acceptance $ACCEPT, budgets $KIMI_BUDGETS, contexts $KIMI_CONTEXTS"
    timeout 330 python -m treeflash.cli bench sweep --preset "$PRESET" --device "$DEVICE" --dtype "$DTYPE" \
      --cuda-graphs --spec off,ddtree --tree-budget "$KIMI_BUDGETS" --acceptance "$ACCEPT" \
      --contexts "$KIMI_CONTEXTS" --max-tokens "$KIMI_TOKENS" --no-progress \
      --out "$OUT/1-$PRESET.json" --plot "$OUT/1-$PRESET.png" 2>&1 | tee "$OUT/1-$PRESET.log"
    rc=${PIPESTATUS[0]}
    ;;
  2)
    say "part 2: shipped pair, real drafter, contexts $PAIR_CONTEXTS"
    timeout 90 python -m treeflash.cli bench sweep --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs \
      --spec off,ddtree --tree-budget 7,15,31,63,auto --acceptance drafter --contexts "$PAIR_CONTEXTS" \
      --max-tokens "$PAIR_TOKENS" --no-progress \
      --out "$OUT/2-shipped-pair.json" --plot "$OUT/2-shipped-pair.png" 2>&1 | tee "$OUT/2-shipped-pair.log"
    rc=${PIPESTATUS[0]}
    ;;
  3)
    say "part 3: serving throughput, shipped pair, concurrency $SERVE_CONCURRENCY"
    timeout 120 python -m treeflash.cli bench serve --device "$DEVICE" --dtype "$DTYPE" \
      --concurrency "$SERVE_CONCURRENCY" --tree-budget off,7,15,31,auto --max-tokens "$SERVE_TOKENS" \
      --prompt-len 256 --out "$OUT/3-serve.json" 2>&1 | tee "$OUT/3-serve.log"
    rc=${PIPESTATUS[0]}
    ;;
  4)
    say "part 4: doctor, $PRESET at ${DOCTOR_CONTEXT:-32k}; tree_sizing at batch 32 (batch 1 is part 1's)"
    timeout 100 python -m treeflash.cli doctor --preset "$PRESET" --device "$DEVICE" --dtype "$DTYPE" \
      --context "${DOCTOR_CONTEXT:-32k}" --max-tokens 24 --batch 32 2>&1 | tee "$OUT/4-doctor-batch32.log" \
      | sed -n '/tree_sizing/,$p'
    rc=${PIPESTATUS[0]}
    ;;
  *) rc=2; echo "unknown part $part" ;;
  esac
  say "part $part done (exit $rc)"
done
say "all parts done; results in $OUT"
