#!/usr/bin/env bash
# fp32 greedy generate of the embedded pair with a runtime option off and on (--runtime-option NAME=0 /
# NAME=1), plain decode and DDTree: the four token lists must be equal (exit 1 if not). Writes
# gen-<spec>-<NAME>-<0|1>.json.
#   bash benchmarks/gen_ab.sh head_matmul <out dir>       (python -m treeflash.cli generate --runtime-option help lists them)
# DTYPE=bfloat16 for a toggle that only changes 16-bit launches: then only each spec's two runs must be
# equal (a bf16 verify's many-row sums may round otherwise than a one-row decode, so off and ddtree may differ).
set -euo pipefail
var=$1 out=$2 dtype=${DTYPE:-float32}
mkdir -p "$out"
for s in 0 1; do
  for sp in off ddtree; do
    python3 -m treeflash.cli generate "def quicksort(xs):" --device cuda --dtype "$dtype" \
      --max-tokens 64 --spec "$sp" --runtime-option "$var=$s" --json > "$out/gen-$sp-$var-$s.json"
  done
done
python3 - "$out" "$var" "$dtype" <<"EOF"
import json, sys
out, var = sys.argv[1:3]
ids = {(sp, s): json.load(open(f"{out}/gen-{sp}-{var}-{s}.json"))["token_ids"] for sp in ("off", "ddtree") for s in (0, 1)}
print({k: v[:8] for k, v in ids.items()})
dtype = sys.argv[3]
for sp in ("off", "ddtree"):
    assert ids[(sp, 0)] == ids[(sp, 1)], f"{sp}: tokens differ with {var}=0 / 1"
if dtype == "float32":
    assert len({tuple(v) for v in ids.values()}) == 1, "tokens differ between off and ddtree"
    print(f"fp32 greedy: the same 64 tokens with {var}=0 / 1, off and ddtree")
else:
    same = ids[("off", 0)] == ids[("ddtree", 0)]
    print(f"{dtype} greedy: each spec the same 64 tokens with {var}=0 / 1 (off and ddtree {'equal' if same else 'differ'})")
EOF
