#!/usr/bin/env bash
# Several benchmarks/gpu_<part>.sh scripts in ONE device call, each under its own wall limit,
# each part's files packed into one tarball (the device tool returns at most 8 files):
#   OUT=$OUT bash benchmarks/gpu_parts.sh w4a16:160 fp8_kv:205 k26_sweep:200
# writes $OUT/<part>.tgz (unpack: tar xzf) and $OUT/parts.log (each part's exit status and time,
# the GPU, the commit). A part that overruns is stopped (SIGTERM, then SIGKILL 10 s later) and
# keeps what it wrote; the next part starts on time.
set -uo pipefail
OUT=${OUT:?set OUT}
export PYTHONUNBUFFERED=1
export TREEFLASH_COMMIT=${TREEFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{ echo "commit $TREEFLASH_COMMIT, $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1; } \
    | tee "$OUT/parts.log"
for spec in "$@"; do
    part=${spec%%:*} limit=${spec##*:}
    script=benchmarks/gpu_${part}.sh
    [[ -f $script ]] || { echo "$part: no $script" | tee -a "$OUT/parts.log"; continue; }
    dir=/tmp/parts/$part; rm -rf "$dir"; mkdir -p "$dir"
    t0=$(date +%s)
    OUT=$dir timeout -k 10 "$limit" bash "$script" > "$dir/stdout.log" 2>&1
    rc=$?
    echo "$part: rc $rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$OUT/parts.log"
    tail -n 25 "$dir/stdout.log"
    tar czf "$OUT/$part.tgz" -C /tmp/parts "$part"
done
