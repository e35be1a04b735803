#!/usr/bin/env bash
# Issue 47 on one GPU (H100 or H200), one device call within ~150 s:
#   OUT=... bash benchmarks/gpu_dcp_model.sh
# 1. the DCP merge on the GPU: 8 ranks' packed partials (one with no key) merged in one launch
#    (kernels/dcp_merge.py) against the torch LSE merge in float64, and its time a call;
# 2. `bench sweep` on the kimi-k2-tp8 preset (a TP8 rank's slice, 4 of 61 layers, extrapolated) at
#    128k, 256k, 512k and 1M context, plain decode and DDTree (budget 15, oracle acceptance), eager
#    (per-part timers: the attention kernel's time a layer), once without DCP and once as one rank
#    of a DCP 8 group (--dcp-model 8: its 1/8 share of the cache, 8 x its heads, the LSE merge),
#    the collectives added at DCP_COLLECTIVE_US a layer (declared: the queries' all-gather and the
#    partials' all-to-all; gpu_multi_dcp.sh measures them on a TP8 machine);
# 3. benchmarks/dcp_model_table.py: per-rank attention us a layer against floor + 5 us, and the
#    step's slope per +1k context under DCP 8 against DCP 1's / 8. JSON, logs and dcp-model.md in $OUT.
# The preset's max_position_embeddings (256k) is raised to 1M for both sweeps (a cost model).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
OUT=${OUT:?set OUT}
CONTEXTS=${CONTEXTS:-128k,256k,512k,1m}
N=${N:-8}
PRESET=${PRESET:-kimi-k2-tp8}  # kimi-k2.6-tp8: the same attention geometry, INT4 experts
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16}  # CPU smoke: PRESET=tiny DEVICE=cpu DTYPE=float32 CONTEXTS=4k,16k
DCP_COLLECTIVE_US=${DCP_COLLECTIVE_US:-30}
MAX_TOKENS=${MAX_TOKENS:-48}
LIMIT=${LIMIT:-60}  # seconds a sweep
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env.log" 2>&1 || true
timeout 30 python3 - "$DEVICE" <<'PY' 2>&1 | tee "$OUT/merge-check.log"
import sys
import torch
from treeflash.models import dcp
dev = sys.argv[1]
impl = None if dev == "cuda" else "triton"  # (the interpreter on a CPU)
g = torch.Generator(device=dev).manual_seed(0)
s, b, n, h, v = 8, 2, 16, 8, 512
out = torch.randn(s, b, n, h, v, device=dev, generator=g).bfloat16()
lse = torch.randn(s, b, n, h, device=dev, generator=g) * 4
lse[3] = float("-inf"); out[3] = float("nan")  # a rank whose share holds no key
want, want_lse = dcp.merge_torch(out.double(), lse.double())
packed = dcp.pack(out, lse)  # as the all-to-all delivers it
got, got_lse = dcp.merge(packed, v, impl)
err = ((got.double() - want).abs() / want.abs().clamp_min(1)).max().item()  # bf16 out: ~2^-8 relative
err_lse = (got_lse.double() - want_lse).abs().max().item()
ok = err < 1.6e-2 and err_lse < 1e-4
print(f"dcp merge (one Triton launch) vs float64 torch: max relative out err {err:.2e}, |lse| err {err_lse:.2e}: "
      f"{'ok' if ok else 'FAIL'}")
if dev != "cuda":
    sys.exit(0)
for _ in range(3): dcp.merge(packed, v, None)
torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True); e0.record()
for _ in range(100): dcp.merge(packed, v, None)
e1.record(); torch.cuda.synchronize()
print(f"dcp merge ({s} ranks x {b * n} rows x {h} heads x {v}): {e0.elapsed_time(e1) * 10:.2f} us a call (eager)")
PY
common=(--preset "$PRESET" --device "$DEVICE" --dtype "$DTYPE" --contexts "$CONTEXTS" --max-position-embeddings 1m
        --speculative-algorithm NONE,DDTREE --speculative-ddtree-budget 15 --acceptance oracle
        --max-tokens "$MAX_TOKENS" --no-progress)
timeout "$LIMIT" python3 -m treeflash.cli bench sweep "${common[@]}" --out "$OUT/sweep-dcp1.json" \
  --plot "$OUT/sweep-dcp1.png" 2>&1 | tee "$OUT/sweep-dcp1.log"
# the DCP N sweep on the first one's ceilings (a probed ceiling differs run to run: floors must match)
ceil=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['ceilings']; print(c['bandwidth'], c['matmul'])" \
  "$OUT/sweep-dcp1.json" 2>/dev/null) && common+=(--bandwidth "${ceil% *}" --matmul "${ceil#* }")
timeout "$LIMIT" python3 -m treeflash.cli bench sweep "${common[@]}" --dcp-model "$N" \
  --dcp-collective-us "$DCP_COLLECTIVE_US" --out "$OUT/sweep-dcp$N.json" --plot "$OUT/sweep-dcp$N.png" \
  2>&1 | tee "$OUT/sweep-dcp$N.log"
python3 benchmarks/dcp_model_table.py "$OUT/sweep-dcp1.json" "$OUT/sweep-dcp$N.json" --out "$OUT/dcp-model.json" \
  2>&1 | tee "$OUT/dcp-model.log"
