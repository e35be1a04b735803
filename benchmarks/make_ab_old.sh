#!/usr/bin/env bash
# ab_old/ for a same-call A/B on the H200 (gitignored; pass carry=["ab_old"] to the device run):
# REV's src/ and the bench scripts the A/B PARTs of gpu_next.sh run from it, without the shipped
# model's weights (the device tool carries at most 64 MiB).
#   bash benchmarks/make_ab_old.sh [REV]        # default: HEAD
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
rm -rf ab_old
mkdir ab_old
git archive "$rev" src benchmarks/bench_kernel.py benchmarks/edges_v5.py benchmarks/benchutil.py \
  | tar -x -C ab_old
find ab_old -name "*.safetensors" -delete
echo "ab_old/ = $(git rev-parse --short "$rev") ($(du -sh ab_old | cut -f1))"
