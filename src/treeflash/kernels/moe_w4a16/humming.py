"""humming-kernels (PyPI `humming-kernels`, the JIT-compiled INT4 MoE GEMMs vLLM uses) as a W4A16
implementation beside ours: `dispatch.py` sends it the row counts where it measured faster, on
layers that hold a copy (`TargetModel.prepare_experts`, by `refusal`). Optional (the `gpu`
extra): where it does not import, no layer gets a copy and our kernels run every call.

One MoE layer's routed experts as vLLM's `HummingIndexedExperts` runs them (fused_humming_moe.py):
the checkpoint's compressed-tensors tensors (`weight_packed`, `weight_scale`, `weight_shape`) load
into two `humming.layer.HummingLayer`s, w13 = [gate; up] ([E, 2 inter, hidden]) and w2 = down,
whose `transform()` repacks them into humming's own layout, once, at load time. A call aligns the
pairs into blocks of the kernel's block size (vLLM's `moe_align_block_size`: sorted pair ids
padded with A = T x top_k, the block's expert, the padded count; here from
`moe_gemm.route_blocks`, on the device, so the call captures into a CUDA graph), runs the indexed
w13 GEMM (input row = pair // top_k), silu(gate) * up, the indexed w2 GEMM (top_k 1) and the
weighted top-k sum. The shared expert runs beside it as three cuBLAS GEMMs, as vLLM's does.

The copy is humming's layout of every routed expert: as many bytes again as ours, kept beside
ours (which the row counts humming is slower at still read): every INT4 layer gets one or none
does (`refusal`): only where humming imports and all copies leave RESERVE of the GPU's memory
free (TREEFLASH_W4A16_HUMMING: auto / 0 / 1). Kimi K2.6 at TP8: 1.11 GiB a layer, 66 GiB for its
60 MoE layers, which do not fit beside the model on one H200 (141 GB): ours alone there.
"""

from __future__ import annotations

import json
import logging

import torch
import torch.nn.functional as F

from treeflash import knobs
from treeflash.kernels.int4 import PACK, Int4Weight

log = logging.getLogger(__name__)

RESERVE = 0.25  # of the GPU's memory left free after the copies (KV cache, graphs, workspace)


def import_error() -> str | None:
    """None when humming imports here, else the reason (its JIT needs CUDA and NVRTC)."""
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


def stack_gate_up(w_gate: Int4Weight, w_up: Int4Weight) -> Int4Weight:
    """w13 = [gate; up] along the output dim ([E, 2 inter, hidden]), still packed: the one
    rearrangement of ours that humming's w13 layer loads (its own repack follows in transform)."""
    if w_gate.shape != w_up.shape or w_gate.group_size != w_up.group_size:
        raise ValueError(f"gate {w_gate.shape} / up {w_up.shape} (groups {w_gate.group_size} / "
                         f"{w_up.group_size}): humming's w13 needs them alike")
    return Int4Weight(torch.cat([w_gate.packed, w_up.packed], dim=-2),
                      torch.cat([w_gate.scale, w_up.scale], dim=-2), w_gate.group_size)


def align(topk_ids: torch.Tensor, experts: int, block: int):
    """(sorted pair ids [blocks x block] int32 padded with A, expert of each block (-1 idle),
    padded count [1] int32) on the device, as vLLM's moe_align_block_size gives them (every
    expert local: ids in 0 .. experts - 1)."""
    from treeflash.kernels.moe_gemm import route_blocks

    a = topk_ids.numel()
    order, blk_e, r0, r1, _, _ = route_blocks(topk_ids, experts, 0, block)
    rows = r0[:, None].long() + torch.arange(block, device=r0.device)  # [blocks, block]
    valid = (rows < r1[:, None]) & (blk_e[:, None] >= 0)
    sorted_ids = torch.where(valid, order.long()[rows.clamp(max=a - 1)], a).to(torch.int32).reshape(-1)
    padded = ((blk_e >= 0).sum() * block).to(torch.int32).reshape(1)
    return sorted_ids, blk_e, padded


def _layer(w: Int4Weight, dtype: torch.dtype):
    """A transformed HummingLayer holding E experts of W [N, K] (compressed-tensors pack-quantized,
    symmetric, K2.6's scheme)."""
    from humming.layer import HummingLayer

    e, n, kw = w.packed.shape
    k = kw * PACK
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": 4,
              "strategy": "group", "group_size": w.group_size, "symmetric": True}
    with torch.device(w.packed.device):
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config=config, num_experts=e, torch_dtype=dtype)
    shape = torch.tensor([n, k], dtype=torch.int64, device=w.packed.device).repeat(e, 1)
    layer.load_from_tensors({"weight_packed": w.packed, "weight_scale": w.scale.to(dtype), "weight_shape": shape})
    layer.transform()
    return layer


class HummingExperts:
    """One layer's routed experts (Int4Weight gate / up [E, inter, hidden], down [E, hidden, inter])
    in humming's layout; __call__ has `kernels.moe_experts`'s contract with every expert local.
    A plain object, not a Module: the copy is no part of the model's state dict."""

    def __init__(self, w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, dtype: torch.dtype):
        from humming.tune import get_heuristics_config

        if w_down.group_size != w_gate.group_size:
            raise ValueError(f"down's group {w_down.group_size} differs from gate's {w_gate.group_size}")
        self.num_experts, self.inter, self.hidden = w_gate.shape
        self.dtype = dtype
        self.w13 = _layer(stack_gate_up(w_gate, w_up), dtype)
        self.w2 = _layer(w_down, dtype)
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        # (min_m, max_m, config) intervals; a call's block size is its interval's block_shape[0]
        self.tuning13 = get_heuristics_config(self.w13.humming_config, gemm_type="indexed")
        self.tuning13_json = json.dumps(self.tuning13)
        self.tuning2_json = json.dumps(get_heuristics_config(self.w2.humming_config, gemm_type="indexed"))

    def refuses(self, x: torch.Tensor, expert_offset: int, num_experts: int | None) -> str | None:
        """None if this copy takes the call, else why not."""
        if x.dtype != self.dtype or not x.is_cuda:
            return f"x is {x.dtype} on {x.device} (the copy is {self.dtype} on CUDA)"
        if expert_offset or (num_experts is not None and num_experts != self.num_experts):
            return "experts sharded across ranks (the copy runs every expert local)"
        return None

    def block_size(self, valid_m: int) -> int:
        for lo, hi, config in self.tuning13:
            if lo < valid_m <= hi:
                return int(config["block_shape"][0])
        raise ValueError(f"humming has no tuning interval for {valid_m} rows")

    def __call__(self, x, topk_weights, topk_ids, shared=None, stats=None) -> torch.Tensor:
        t, k = topk_ids.shape
        a = t * k
        sorted_ids, expert_ids, padded = align(topk_ids, self.num_experts, self.block_size(a))
        if stats is not None:
            from treeflash.kernels.moe_gemm import _count_stats

            _count_stats(topk_ids, stats)
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


def wanted() -> bool:
    """Whether layers should get a copy: TREEFLASH_W4A16_HUMMING not 0 and the table names humming
    for some rows (or TREEFLASH_W4A16_IMPL pins it)."""
    from treeflash.kernels.moe_w4a16 import dispatch

    if knobs.get("TREEFLASH_W4A16_HUMMING") == "0":
        return False
    return knobs.get("TREEFLASH_W4A16_IMPL") == dispatch.HUMMING or any(r.humming for r in dispatch.RULES)


def fits(nbytes: int, device: torch.device) -> bool:
    """Copies of nbytes leave RESERVE of the device's memory free (one layer's copy more counted:
    the transform's temporaries)."""
    free, total = torch.cuda.mem_get_info(device)
    return free - nbytes >= RESERVE * total


def refusal(layers: list[tuple[Int4Weight, Int4Weight, Int4Weight]]) -> str | None:
    """None when every one of these layers' experts (gate, up, down) should get a copy, else why
    none does: all or nothing, so that memory and speed do not depend on the layer.
    TREEFLASH_W4A16_HUMMING=1 turns a refusal (other than no INT4 layers) into an error."""
    if not layers:
        return "no INT4 expert layers"
    if not wanted():
        return "not wanted (TREEFLASH_W4A16_HUMMING=0, or no dispatch row names humming)"
    device = layers[0][0].packed.device
    err = import_error() if device.type == "cuda" else "experts not on a CUDA device"
    nbytes = sum(w.nbytes for layer in layers for w in layer)
    if err is None and not fits(nbytes + nbytes // len(layers), device):
        err = (f"copies of {nbytes / 2**30:.1f} GiB ({len(layers)} layers) would leave less than {RESERVE:.0%} "
               "of the GPU free")
    if err is not None and knobs.get("TREEFLASH_W4A16_HUMMING") == "1":
        raise RuntimeError(f"TREEFLASH_W4A16_HUMMING=1: humming-kernels unusable: {err}")
    return err
