#!/usr/bin/env bash
# Build the embedded model pair end to end inside one wall-clock budget (one H200 call):
# tokenizer -> target -> drafter -> eval. Each stage leaves its artifacts in OUT as soon as
# it is done (target.tar.gz, drafter.tar.gz, data.tar.gz, metrics.json), so a run cut short
# still returns what it finished. The two training stages get time budgets computed from
# what is left: 65% target, the rest drafter, after reserving time for the evaluation.
#
#   scripts/train_embedded_pair.sh OUT [BUDGET_SECONDS]      (needs treeflash.train importable)
#   SMOKE=1 SMOKE_CORPUS=DIR scripts/train_embedded_pair.sh OUT 120   (tiny CPU rehearsal)
set -uo pipefail
OUT=${1:?usage: $0 OUT [BUDGET_SECONDS]}
BUDGET=${2:-555}
WORK=${WORK:-/tmp/treeflash_train}
PY=${PY:-python3}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
tf() { echo "== [$(elapsed)s] treeflash train $*"; $PY -m treeflash.train.cli "$@"; }
mkdir -p "$OUT" "$WORK"
export TOKENIZERS_PARALLELISM=true PYTHONUNBUFFERED=1

if [ "${SMOKE:-0}" = 1 ]; then
  TOK_ARGS=(--corpus "${SMOKE_CORPUS:?}" --vocab-size 400 --heldout-percent 20)
  T_ARGS=(--preset tiny --seq-len 96 --batch-size 2 --eval-every 20 --eval-batches 1)
  D_ARGS=(--preset tiny --seq-len 96 --batch-size 2 --anchors 8 --eval-every 20 --eval-batches 1)
  E_ARGS=(--prompts 3 --prompt-len 32 --new-tokens 12 --seq-len 64 --loss-windows 1 --long-len 0
          --context-lengths 48 --context-prompts 1 --budgets 4 --reference-prompts 1)
  EVAL_RESERVE=25; OVERHEAD=20
else
  TOK_ARGS=(--vocab-size 4096 --max-bytes 300M --sample-bytes 20M)
  T_ARGS=(--preset small --seq-len 8192 --batch-size 8 --eval-every 250 --save-every 100000)
  D_ARGS=(--preset small --seq-len 8192 --batch-size 4 --anchors 512 --eval-every 100 --save-every 100000)
  E_ARGS=()
  EVAL_RESERVE=${EVAL_RESERVE:-80}; OVERHEAD=45
fi

tf tokenizer --out "$WORK/tok" "${TOK_ARGS[@]}" || exit 1
tar -C "$WORK/tok" -czf "$OUT/data.tar.gz" tokenizer.json tokenizer_config.json data/manifest.json \
    data/heldout.bin data/heldout_files.jsonl

LEFT=$(( BUDGET - $(elapsed) - EVAL_RESERVE - OVERHEAD ))
TB=$(( LEFT * 65 / 100 ))
tf target --data "$WORK/tok" --out "$WORK/target" "${T_ARGS[@]}" --time-budget "$TB" --no-progress || exit 1
tar -C "$WORK" -czf "$OUT/target.tar.gz" --exclude checkpoint.pt target

DB=$(( BUDGET - $(elapsed) - EVAL_RESERVE - OVERHEAD / 2 ))
[ "$DB" -lt 10 ] && DB=10
tf drafter --data "$WORK/tok" --target "$WORK/target" --out "$WORK/drafter" "${D_ARGS[@]}" \
    --time-budget "$DB" --no-progress || exit 1
tar -C "$WORK" -czf "$OUT/drafter.tar.gz" --exclude checkpoint.pt drafter

EB=$(( BUDGET - $(elapsed) ))
[ "$EB" -lt 15 ] && EB=15
timeout "$EB" $PY -m treeflash.train.cli eval --data "$WORK/tok" --target "$WORK/target" \
    --drafter "$WORK/drafter" --out "$OUT/metrics.json" "${E_ARGS[@]}"
echo "== done in $(elapsed)s (eval exit $?)"
