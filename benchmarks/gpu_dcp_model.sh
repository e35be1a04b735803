#!/usr/bin/env bash
# Issue 47 on one GPU (H100 or H200), one device call within ~150 s:
#   OUT=... bash benchmarks/gpu_dcp_model.sh
# 1. the DCP merge on the GPU: 8 ranks' packed partials (one with no key) merged in one launch
#    (kernels/dcp_merge.py) against the torch LSE merge in float64, and its time a call;
# 2. `bench kernel --dcp N` (bench/kernel_dcp.py): at 128k, 256k, 512k and 1M, plain decode (1 row) and
#    a DDTree verify (ROWS rows), one DCP N rank's attention a layer as the GPU runs a step -- a CUDA
#    graph of 61 layers' calls: the verify kernel over its page-64 dealt share (context / N) with the
#    group's N x 8 heads, the send buffer's pack, the LSE merge -- and DCP 1's
#    (the verify kernel over the whole context, 8 heads), each against its floor + 5 us;
# 3. `bench sweep --cuda-graphs` on kimi-k2-tp8 (a TP8 rank's slice, 4 of 61 layers, extrapolated),
#    DCP 1, the same contexts, plain and DDTree (budget ROWS - 1, oracle acceptance): ms a step;
# 4. benchmarks/dcp_model_table.py: the DCP N step COMPOSED from DCP 1's with the rank's attention in
#    place of DCP 1's, layer for layer, + DCP_COLLECTIVE_US a layer (declared: the queries' all-gather and
#    the partials' all-to-all; gpu_multi_dcp.sh measures them on a TP8 machine), and per mode the
#    slope per +1k context against DCP 1's / N. JSON, logs and dcp-model.md in $OUT.
# (`bench sweep --dcp-model N` runs eager -- its per-part timers are not a step's time -- so it is not used.)
# The preset's max_position_embeddings (256k) is raised to 1M for the sweep (a cost model).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
OUT=${OUT:?set OUT}
CONTEXTS=${CONTEXTS:-128k,256k,512k,1024k}
N=${N:-8}
PRESET=${PRESET:-kimi-k2-tp8}  # kimi-k2.6-tp8: the same attention geometry, INT4 experts
ROWS=${ROWS:-32}  # a DDTree verify's rows (budget ROWS - 1)
DCP_COLLECTIVE_US=${DCP_COLLECTIVE_US:-30}
MAX_TOKENS=${MAX_TOKENS:-224}  # a 32-row tree at full acceptance: 7 steps (2 warm-up), more if shallower
KLIMIT=${KLIMIT:-70} LIMIT=${LIMIT:-60}  # seconds: the kernel timing, the sweep
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env.log" 2>&1 || true
timeout 25 python3 - <<'PY' 2>&1 | tee "$OUT/merge-check.log"
import statistics
import torch
from treeflash.bench.kernel_timing import _time_graph
from treeflash.models import dcp
g = torch.Generator(device="cuda").manual_seed(0)
s, b, n, h, v = 8, 1, 32, 8, 512  # TP8 x DCP8: a 32-row verify's partials of a rank's 8 heads
out = torch.randn(s, b, n, h, v, device="cuda", generator=g).bfloat16()
lse = torch.randn(s, b, n, h, device="cuda", generator=g) * 4
lse[3] = float("-inf"); out[3] = float("nan")  # a rank whose share holds no key
want, want_lse = dcp.merge_torch(out.double(), lse.double())
packed = dcp.pack(out, lse)  # as the all-to-all delivers it
got, got_lse = dcp.merge(packed, v, None)
err = ((got.double() - want).abs() / want.abs().clamp_min(1)).max().item()  # bf16 out: ~2^-8 relative
err_lse = (got_lse.double() - want_lse).abs().max().item()
ok = err < 1.6e-2 and err_lse < 1e-4
print(f"dcp merge (one Triton launch) vs float64 torch: max relative out err {err:.2e}, |lse| err {err_lse:.2e}: "
      f"{'ok' if ok else 'FAIL'}")
ms = statistics.median(_time_graph(lambda layer: dcp.merge(packed, v, None), 61, 3))
print(f"dcp merge ({s} ranks x {b * n} rows x {h} heads x {v}): {ms / 61 * 1e3:.2f} us a call (CUDA graph of 61)")
PY
timeout "$KLIMIT" python3 -m treeflash.cli bench kernel --dcp "$N" --contexts "$CONTEXTS" --dcp-rows "1,$ROWS" \
  --dcp-heads 8 --layers 61 --graph-replays 3 --budget-s "$((KLIMIT - 20))" --out "$OUT" --tag dcp 2>&1 | tee "$OUT/kernel-dcp.log"
kjson=$(ls -t "$OUT"/kernel-*-dcp.json 2>/dev/null | head -1)
ceil=()  # the sweep's floors on the kernel's ceilings (a probed ceiling differs run to run)
[ -n "$kjson" ] && ceil=(--bandwidth "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ceilings']['bytes_per_s'])" "$kjson")"
                         --matmul "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ceilings']['flops_per_s'])" "$kjson")")
timeout "$LIMIT" python3 -m treeflash.cli bench sweep --preset "$PRESET" --device cuda --dtype bfloat16 --cuda-graphs \
  --contexts "$CONTEXTS" --max-position-embeddings 1m --speculative-algorithm NONE,DDTREE \
  --speculative-ddtree-budget "$((ROWS - 1))" --acceptance oracle --max-tokens "$MAX_TOKENS" --no-progress "${ceil[@]}" \
  --out "$OUT/sweep-dcp1.json" --plot "$OUT/sweep-dcp1.png" 2>&1 | tee "$OUT/sweep-dcp1.log"
[ -n "$kjson" ] && python3 benchmarks/dcp_model_table.py "$kjson" "$OUT/sweep-dcp1.json" \
  --collective-us "$DCP_COLLECTIVE_US" --out "$OUT/dcp-model.json" 2>&1 | tee "$OUT/dcp-model.log"
