#!/usr/bin/env bash
# fp32 greedy generate of the embedded pair with an env toggle off and on (VAR=0 / VAR=1), plain
# decode and DDTree: the four token lists must be equal (exit 1 if not). Writes gen-<spec>-<VAR>-<0|1>.json.
#   bash benchmarks/gen_ab.sh TREEFLASH_HEAD_MATMUL <out dir>
set -euo pipefail
var=$1 out=$2
mkdir -p "$out"
for s in 0 1; do
  for sp in off ddtree; do
    env "$var=$s" python3 -m treeflash.cli generate "def quicksort(xs):" --device cuda --dtype float32 \
      --max-tokens 64 --spec "$sp" --json > "$out/gen-$sp-$var-$s.json"
  done
done
python3 - "$out" "$var" <<"EOF"
import json, sys
out, var = sys.argv[1:]
ids = {(sp, s): json.load(open(f"{out}/gen-{sp}-{var}-{s}.json"))["token_ids"] for sp in ("off", "ddtree") for s in (0, 1)}
print({k: v[:8] for k, v in ids.items()})
assert len({tuple(v) for v in ids.values()}) == 1, "tokens differ"
print(f"fp32 greedy: the same 64 tokens with {var}=0 / 1, off and ddtree")
EOF
