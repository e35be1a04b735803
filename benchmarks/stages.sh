# Sourced by the one-call GPU scripts (gpu_first_contact.sh, gpu_measure.sh, gpu_next.sh):
#   source benchmarks/stages.sh WORKDIR TARBALL_NAME
# Each `stage NAME CAP_SECONDS COMMAND...` runs under its own timeout and the call's DEADLINE
# (seconds since sourcing), logs to WORKDIR/NAME.log, appends a line to $OUT/summary.log and
# re-packs WORKDIR into $OUT/TARBALL_NAME, so a call cut short still returns what finished.
OUT=${OUT:?set OUT}
DEADLINE=${DEADLINE:-540}
W=$1
TARBALL=$2
rm -rf "$W"; mkdir -p "$W" "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
T0=$(date +%s)
stage() {  # stage NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) - 10 ))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 5 ]; then echo "SKIP $name (deadline)" | tee -a "$OUT/summary.log"; return; fi
  local t=$(date +%s)
  timeout "$cap" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  echo "$(printf '%-28s' "$name") rc=$rc $(( $(date +%s) - t ))s (cap ${cap}s): $(tail -n 1 "$W/$name.log" | cut -c1-150)" \
    | tee -a "$OUT/summary.log"
  tar -C "$W" -czf "$OUT/$TARBALL" .
  return $rc
}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python3 -c "import torch, triton, sys; \
print(sys.version.split()[0], torch.__version__, triton.__version__)"; echo "${TREEFLASH_COMMIT:-$(git rev-parse HEAD)}"; } > "$W/env.log" 2>&1
cat "$W/env.log" >> "$OUT/summary.log"
