"""humming-kernels (PyPI `humming-kernels`, vLLM's JIT-compiled INT4 MoE GEMMs) on the same INT4
experts as `kernels/moe_w4a16.py`, for `treeflash bench moe`'s ratio. Benchmark-only: the serving
path never imports it.

One MoE layer's routed experts as vLLM's `HummingIndexedExperts` runs them (fused_humming_moe.py):
the checkpoint's compressed-tensors tensors (`weight_packed`, `weight_scale`, `weight_shape`) load
into two `humming.layer.HummingLayer`s, w13 = [gate; up] ([E, 2 inter, hidden]) and w2 = down,
which `transform()` repacks into humming's own layout; a call aligns the pairs into blocks of the
kernel's block size (vLLM's `moe_align_block_size`: sorted pair ids padded with A = T x top_k per
block, the block's expert, the padded count; here from `moe_gemm.route_blocks`, on the device, so
the call captures into a CUDA graph), runs the indexed w13 GEMM (input row = pair // top_k),
silu(gate) * up, the indexed w2 GEMM (top_k 1) and the weighted top-k sum. The shared expert runs
beside it as three cuBLAS GEMMs, as vLLM's shared-experts path does.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from treeflash.kernels.int4 import PACK, Int4Weight


def import_error() -> str | None:
    """None when humming imports here, else the reason (its JIT needs CUDA and nvcc / NVRTC)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import humming  # noqa: F401
        from humming.layer import HummingLayer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None


def version() -> str:
    import humming

    return getattr(humming, "__version__", "unknown")


def _layer(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype):
    """A transformed HummingLayer holding E experts of W [N, K] (packed [E, N, K / 8] int32,
    scale [E, N, K / group]) as the compressed-tensors pack-quantized scheme K2.6 publishes."""
    from humming.layer import HummingLayer

    e, n, kw = packed.shape
    k = kw * PACK
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": 4,
              "strategy": "group", "group_size": group, "symmetric": True}
    with torch.device(packed.device):
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config=config, num_experts=e, torch_dtype=dtype)
    shape = torch.tensor([n, k], dtype=torch.int64, device=packed.device).repeat(e, 1)
    layer.load_from_tensors({"weight_packed": packed, "weight_scale": scale.to(dtype), "weight_shape": shape})
    layer.transform()
    return layer


class HummingExperts:
    """One layer's routed experts (Int4Weight gate / up [E, inter, hidden], down [E, hidden, inter])
    through humming; __call__ has `kernels.moe_experts`'s contract (every expert local)."""

    def __init__(self, w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, dtype: torch.dtype):
        from humming.tune import get_heuristics_config

        assert w_gate.group_size == w_up.group_size == w_down.group_size, "one group size"
        self.num_experts, self.inter, self.hidden = w_gate.shape
        packed13 = torch.cat([w_gate.packed, w_up.packed], dim=1)  # [E, 2 inter, hidden / 8]
        scale13 = torch.cat([w_gate.scale, w_up.scale], dim=1)
        self.w13 = _layer(packed13, scale13, w_gate.group_size, dtype)
        del packed13, scale13
        self.w2 = _layer(w_down.packed, w_down.scale, w_down.group_size, dtype)
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        # (min_m, max_m, config) intervals; a call's block size is its interval's block_shape[0]
        self.tuning13 = get_heuristics_config(self.w13.humming_config, gemm_type="indexed")
        self.tuning13_json = json.dumps(self.tuning13)
        self.tuning2_json = json.dumps(get_heuristics_config(self.w2.humming_config, gemm_type="indexed"))

    def block_size(self, valid_m: int) -> int:
        for lo, hi, config in self.tuning13:
            if lo < valid_m <= hi:
                return int(config["block_shape"][0])
        raise ValueError(f"humming has no tuning interval for {valid_m} rows")

    def _align(self, topk_ids: torch.Tensor, block: int):
        """(sorted pair ids [blocks x block] int32 padded with A, expert of each block (-1 idle),
        padded count [1] int32) on the device, as vLLM's moe_align_block_size gives them."""
        from treeflash.kernels.moe_gemm import route_blocks

        a = topk_ids.numel()
        order, blk_e, r0, r1, _, _ = route_blocks(topk_ids, self.num_experts, 0, block)
        rows = r0[:, None].long() + torch.arange(block, device=r0.device)  # [blocks, block]
        valid = (rows < r1[:, None]) & (blk_e[:, None] >= 0)
        sorted_ids = torch.where(valid, order.long()[rows.clamp(max=a - 1)], a).to(torch.int32).reshape(-1)
        padded = ((blk_e >= 0).sum() * block).to(torch.int32).reshape(1)
        return sorted_ids, blk_e, padded

    def __call__(self, x, topk_weights, topk_ids, shared=None) -> torch.Tensor:
        t, k = topk_ids.shape
        a = t * k
        sorted_ids, expert_ids, padded = self._align(topk_ids, self.block_size(a))
        kw = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded, valid_shape_m=a,
                  compute_config=self.compute)
        gate_up = self.w13.forward(x, top_k=k, tuning_config=self.tuning13_json, **kw)  # [A, 2 inter]
        h = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
        down = self.w2.forward(h, top_k=1, tuning_config=self.tuning2_json, **kw)  # [A, hidden]
        out = (down.view(t, k, self.hidden).float() * topk_weights[..., None].float()).sum(1)
        if shared is not None:
            sg, su, sd = shared
            out = out + F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd).float()
        return out.to(x.dtype)
