#!/usr/bin/env bash
# Continue training ONLY the shipped DFlash drafter against the shipped, frozen target, inside
# one wall-clock budget (one H200 call), then evaluate the pair:
#   tokenizer stage with the SHIPPED tokenizer (no new BPE: token ids must match the shipped
#   target) -> drafter --init src/treeflash/assets/drafter -> eval.
# Artifacts in OUT as each stage finishes: data.tar.gz (tokenizer + held-out data, for
# re-evaluating elsewhere), drafter.tar.gz (drafter/{config.json,model.safetensors,
# train_metrics.json}, no checkpoint), metrics.json, retrain.log. The drafter's time budget
# is what is left after the tokenizer stage, less EVAL_RESERVE (70 s) for the evaluation
# and OVERHEAD (20 s: imports, loading the target and the 376 MB token stream, export).
#
#   scripts/retrain_drafter.sh OUT [BUDGET_SECONDS]                    (default 470)
#   WHEELS=.train_whl scripts/retrain_drafter.sh OUT 470               (first installs the carried
#       transformers/dflash/regex wheels into WORK/site and puts it first on PYTHONPATH)
#   SMOKE=1 SMOKE_CORPUS=DIR scripts/retrain_drafter.sh OUT 90         (CPU rehearsal, ~90 s)
#   LR=1e-3 SEED=2 ...                                                 (peak lr and seed; defaults 1e-3, 1)
#
# Choices (the rest is scripts/train_embedded_pair.sh's drafter recipe: preset small,
# seq-len 8192, batch 4, 512 anchors, weight decay 0.01, cosine to 10% at the time budget):
# - peak lr 1e-3, not the 1.5e-3 of training from scratch: this is a warm start; the shipped
#   drafter ended its cosine at 1.5e-4, and re-warming all the way to 1.5e-3 with a fresh
#   AdamW state would undo more of it before it helps. 1e-3 is still high enough to keep
#   making the fast progress the first run was making when its 106 s ran out.
# - 30 warmup steps (~2 s on the H200): the optimizer moments start at zero again; a short
#   ramp keeps the first, noisy Adam steps small, a long one would waste the budget.
# - --seed 1: seed 0 would replay the first run's data windows and anchors in the same order.
# - eval every 250 steps (history in train_metrics.json) and the same `treeflash train eval`
#   arguments as the shipped MODEL_CARD figures, so the numbers compare one to one.
# - The SMOKE rehearsal uses the same shipped tokenizer, target and --init drafter (preset
#   small) at a 96-token context, so it runs the exact GPU path, only shorter.
set -uo pipefail
OUT=${1:?usage: $0 OUT [BUDGET_SECONDS]}
BUDGET=${2:-470}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ASSETS=$REPO/src/treeflash/assets
WORK=${WORK:-$(mktemp -d /tmp/treeflash_retrain.XXXXXX)}
PY=${PY:-python3}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "== [$(elapsed)s] $*"; }
tf() { say "treeflash train $*"; $PY -m treeflash.train.cli "$@"; }
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/retrain.log") 2>&1
TEE_PID=$!
trap 'exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT  # let tee finish the log before we return
export TOKENIZERS_PARALLELISM=true PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
say "retrain_drafter: budget ${BUDGET}s, WORK=$WORK, OUT=$OUT"

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --target "$WORK/site" "$WHEELS"/transformers-*.whl \
      "$WHEELS"/dflash-*.whl || { say "wheel install failed"; exit 1; }
  # regex is built for one Python (cp312); where it does not fit, the machine's own regex serves
  $PY -m pip install -q --no-index --no-deps --target "$WORK/site" "$WHEELS"/regex-*.whl \
      || say "regex wheel not installed (using the machine's regex)"
  export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
# Fail in seconds, not after the tokenizer stage, if the stack does not import.
$PY - <<'EOF' || { say "imports failed: see above"; exit 1; }
import sys, torch, transformers, dflash
from dflash.model import DFlashDraftModel  # noqa: F401
import treeflash.train.cli  # noqa: F401
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__} "
      f"({transformers.__file__}), dflash {dflash.__file__}, cuda {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
EOF

if [ "${SMOKE:-0}" = 1 ]; then
  TOK_ARGS=(--corpus "${SMOKE_CORPUS:?}" --heldout-percent 20)
  D_ARGS=(--seq-len 96 --batch-size 2 --anchors 8 --eval-every 100 --eval-batches 1 --device cpu)
  E_ARGS=(--prompts 3 --prompt-len 32 --new-tokens 12 --seq-len 64 --loss-windows 1 --long-len 0
          --context-lengths 48 --context-prompts 1 --budgets 4 --reference-prompts 1 --device cpu)
  EVAL_RESERVE=${EVAL_RESERVE:-30}; OVERHEAD=${OVERHEAD:-15}
else
  TOK_ARGS=(--max-bytes 300M)
  D_ARGS=(--seq-len 8192 --batch-size 4 --anchors 512 --eval-every 250 --save-every 100000)
  E_ARGS=()
  EVAL_RESERVE=${EVAL_RESERVE:-70}; OVERHEAD=${OVERHEAD:-20}
fi

tf tokenizer --out "$WORK/tok" --tokenizer "$ASSETS/target" "${TOK_ARGS[@]}" || exit 1
tar -C "$WORK/tok" -czf "$OUT/data.tar.gz" tokenizer.json tokenizer_config.json data/manifest.json \
    data/heldout.bin data/heldout_files.jsonl
# Same corpus as the shipped pair's run? (Only then are held-out files surely unseen by the target.)
$PY - "$WORK/tok/data/manifest.json" "$REPO/benchmarks/results/embedded_pair_h200.json" <<'EOF'
import json, sys
now = json.load(open(sys.argv[1]))
try:
    then = json.load(open(sys.argv[2]))["corpus"]
except (OSError, KeyError, ValueError):
    then = None
keys = ("train_files", "heldout_files", "train_bytes", "heldout_bytes", "tokens")
if then is not None:
    same = all(now.get(k) == then.get(k) for k in keys)
    print("corpus vs the shipped pair's run:", "identical" if same else "DIFFERENT",
          {k: (now.get(k), then.get(k)) for k in keys if now.get(k) != then.get(k)})
EOF

DB=$(( BUDGET - $(elapsed) - EVAL_RESERVE - OVERHEAD ))
[ "$DB" -lt 10 ] && DB=10
tf drafter --data "$WORK/tok" --target "$ASSETS/target" --out "$WORK/drafter" --preset small \
    --init "$ASSETS/drafter" --lr "${LR:-1e-3}" --warmup-steps 30 --seed "${SEED:-1}" "${D_ARGS[@]}" \
    --time-budget "$DB" --no-progress || exit 1
tar -C "$WORK" -czf "$OUT/drafter.tar.gz" --exclude checkpoint.pt drafter
say "drafter saved to $OUT/drafter.tar.gz"

EB=$(( BUDGET - $(elapsed) ))
[ "$EB" -lt 15 ] && EB=15
say "treeflash train eval (timeout ${EB}s)"
timeout "$EB" $PY -m treeflash.train.cli eval --data "$WORK/tok" --target "$ASSETS/target" \
    --drafter "$WORK/drafter" --out "$OUT/metrics.json" "${E_ARGS[@]}"
RC=$?
say "done (eval exit $RC)"
exit "$RC"
