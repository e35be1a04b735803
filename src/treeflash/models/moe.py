"""Mixture of experts with DeepSeek-V3 / Kimi-K2 routing.

Routing (in float32, as the reference): scores = sigmoid or softmax of the gate logits;
`noaux_tc` adds `e_score_correction_bias` for the choice only, keeps the `topk_group`
groups with the best top-2 sums and takes the top-k experts inside them; `greedy` takes
the top-k over all experts; `group_limited_greedy` ranks groups by their best expert.
Weights come from the unbiased scores, optionally renormalised, times
`routed_scaling_factor`. Shared experts are added to every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflash import kernels
from treeflash.config import ModelConfig
from treeflash.kernels.int4 import PACK, Int4Weight
from treeflash.models.layers import MLP
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sharding import Parallel


class Gate(nn.Module):
    """Router: the logits GEMM in torch (float32), then `kernels.moe_gate` (one Triton launch
    on CUDA instead of ~12-15 small kernels; `options.fused_gate` off keeps the torch ops).
    On the Triton path `kernels.moe_gate_fused` folds the GEMM in (one launch instead of a cast,
    a float32 cuBLAS GEMM, its split-K reduce and the gate kernel): always for a small router
    (`moe_router.fused_logits_ok`: E * hidden <= 32768, e.g. the shipped pair's 8 x 256), and for
    DeepSeek-V3 / Kimi-K2 sized ones at decode / verify sizes (`split_logits_ok`: <= 4 rows, <= 64
    with x and the weight in one 16-bit dtype; `options.split_router` off keeps the GEMM there)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.options = options
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.impl: str | None = None  # kernels' impl: None = Triton on CUDA, torch otherwise
        # float32 copy of a low-precision weight, so that a step does not re-cast it (a full
        # copy of the weight per layer per step); keyed on (data_ptr, _version): reloads and
        # in-place updates invalidate it. Not in the state dict.
        self._w32: torch.Tensor | None = None
        self._w32_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        cfg = self.cfg
        if torch.is_grad_enabled() and self.weight.requires_grad:  # training: torch ops, autograd
            w32, impl = self.weight.float(), "torch"
        else:
            impl = self._impl(x)
            w = self._fused_weight(x.shape[0], x.dtype) if kernels._pick(impl, x) == "triton" else None
            if w is not None:
                return kernels.moe_gate_fused(x, w, self.e_score_correction_bias, cfg.scoring_func,
                                              cfg.topk_method, cfg.n_group, cfg.topk_group,
                                              cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                              cfg.routed_scaling_factor, impl="triton")
            w32 = self._weight_f32()
        logits = F.linear(x.float(), w32)  # [T, E]
        return kernels.moe_gate(logits, self.e_score_correction_bias, cfg.scoring_func, cfg.topk_method,
                                cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                cfg.routed_scaling_factor, impl=impl)

    def _impl(self, x: torch.Tensor) -> str | None:
        if self.impl is None and x.is_cuda and not self.options.fused_gate:
            return "torch"
        return self.impl

    def _fused_weight(self, t: int, x_dtype: torch.dtype) -> torch.Tensor | None:
        """The weight `kernels.moe_gate_fused` takes for t rows on the Triton path, or None where
        the GEMM + `moe_gate` path is meant: the float32 copy for a small router (one program a
        row), the weight as stored at decode / verify sizes (the split launch reads it in its own
        dtype: half the bytes of the float32 copy), None for longer forwards, and for large routers
        with `options.split_router` off."""
        from treeflash.kernels.moe_router import fused_logits_ok, split_logits_ok

        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        if fused_logits_ok(e, self.cfg.hidden_size, k):
            return self._weight_f32()
        if (split_logits_ok(t, e, k, x_dtype, self.weight.dtype)
                and self.options.split_router):
            return self.weight
        return None

    def _weight_f32(self) -> torch.Tensor:
        """The weight in float32: cached for a small router (the one-program-a-row kernel's, every
        step); a large one's GEMM path (prefill, or `options.split_router` off) casts each call
        rather than keep a float32 copy of every layer's router beside the weight."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        from treeflash.kernels.moe_router import fused_logits_ok

        if not fused_logits_ok(self.cfg.n_routed_experts, self.cfg.hidden_size, self.cfg.num_experts_per_tok):
            return w.float()
        try:
            key = (w.data_ptr(), w._version, w.device)
        except RuntimeError:  # an inference tensor has no version counter
            key = (w.data_ptr(), None, w.device)
        if self._w32 is None or key != self._w32_key:
            self._w32, self._w32_key = w.detach().float(), key
        return self._w32


class MoE(nn.Module):
    """Routed experts stored stacked ([E, inter, hidden]) plus the shared experts.

    The routed experts are Parameters experts_{gate,up,down} in the model's dtype, or, where
    the checkpoint stores them INT4 (`cfg.experts_int4(layer)`: compressed-tensors
    pack-quantized, W4A16), buffers experts_{gate,up}_packed int32 [E, inter, hidden / 8],
    experts_down_packed [E, hidden, inter / 8] and experts_*_scale bf16 [E, N, K / group]
    (`kernels/int4.py`), kept packed. `routed_weights()` hands either kind to the kernels.

    Sharded (see `treeflash.sharding`): a rank holds experts expert_offset ..
    expert_offset + E/ep, each with inter/(tp/ep) of its intermediate dim, and tp-th of
    the shared experts. Every rank routes every token (the router is replicated), computes
    its part, and the caller all-reduces the sum.
    """

    def __init__(self, cfg: ModelConfig, parallel: Parallel | None = None, layer: int | None = None,
                 options: RuntimeOptions = DEFAULT):
        super().__init__()
        par = parallel or Parallel()
        self.options = options
        e, hidden = par.local_experts(cfg), cfg.hidden_size
        inter = cfg.moe_intermediate_size // par.moe_tp_size
        self.expert_offset = par.expert_offset(cfg)
        self.gate = Gate(cfg, options)
        int4 = cfg.experts_int4(layer) if layer is not None else bool(cfg.int4_expert_layers)
        self.int4_group = cfg.int4_group_size if int4 else None
        shapes = {"gate": (e, inter, hidden), "up": (e, inter, hidden), "down": (e, hidden, inter)}
        for kind, (n_e, n, k) in shapes.items():
            if self.int4_group is None:
                setattr(self, f"experts_{kind}", nn.Parameter(torch.empty(n_e, n, k)))
                continue
            self.register_buffer(f"experts_{kind}_packed", torch.empty(n_e, n, k // PACK, dtype=torch.int32))
            self.register_buffer(f"experts_{kind}_scale",
                                 torch.empty(n_e, n, k // self.int4_group, dtype=torch.bfloat16))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts // par.tp_size
        self.shared_experts = MLP(hidden, shared) if cfg.n_shared_experts else None
        # Routing statistics on the device, [E] int64 over all experts (routing is replicated):
        # the last forward's tokens per expert, and the running sum since reset_expert_counts().
        self.last_expert_counts: torch.Tensor | None = None
        self.expert_counts_total: torch.Tensor | None = None
        self.impl: str | None = None  # kernels' impl: None = Triton on CUDA, torch otherwise
        # INT4 experts' copy in humming-kernels' layout (`TargetModel.prepare_experts`), run at the
        # rows the W4A16 dispatch measured it faster at; a plain object, not in the state dict
        self.int4_copy = None

    @property
    def expert_format(self) -> str:
        """How the routed experts are stored: "int4" (W4A16) or the torch dtype's name."""
        return "int4" if self.int4_group is not None else str(self.experts_gate.dtype).removeprefix("torch.")

    def routed_weights(self) -> tuple[torch.Tensor | Int4Weight, torch.Tensor | Int4Weight,
                                      torch.Tensor | Int4Weight]:
        """(gate [E, inter, hidden], up [E, inter, hidden], down [E, hidden, inter]) of this rank's
        experts: tensors, or `Int4Weight` views of the packed buffers (logical shapes the same)."""
        if self.int4_group is None:
            return self.experts_gate, self.experts_up, self.experts_down
        return tuple(Int4Weight(getattr(self, f"experts_{k}_packed"), getattr(self, f"experts_{k}_scale"),
                                self.int4_group) for k in ("gate", "up", "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        stats = self._stats(flat)
        weights, ids = self.gate(flat)  # [T, k]
        # One grouped call over every (token, expert) pair: no host sync, each touched
        # expert's weights read once per block of rows (kernels/moe_gemm.py on CUDA); it also
        # fills the routing statistics (in its routing launch where every expert is local).
        shared = self._shared_in_call(flat)
        out = kernels.moe_experts(flat, weights, ids, *self.routed_weights(), self.expert_offset,
                                  self.gate.cfg.n_routed_experts, impl=self.impl, shared=shared,
                                  stats=stats, int4_copy=self.int4_copy, **self._tuning())
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _shared_in_call(self, flat: torch.Tensor):
        """The shared experts' weights when the Triton grouped call can run them as more
        experts (inference, intermediate size a multiple of the routed one's, e.g. Kimi K2 /
        DeepSeek-V3 at TP8 or the shipped pair): their ~5 cuBLAS / elementwise launches and
        the add disappear. `options.moe_shared` off keeps the separate MLP."""
        mlp = self.shared_experts
        if (mlp is None or kernels._pick(self.impl, flat) != "triton"
                or not self.options.moe_shared
                or (torch.is_grad_enabled() and mlp.gate_proj.weight.requires_grad)):
            return None
        from treeflash.kernels.moe_gemm import shared_chunks

        w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        if w[0].dtype != flat.dtype or not shared_chunks(w, self.routed_weights()[0].shape[1]):
            return None
        return w

    def _tuning(self) -> dict:
        """The grouped call's tiles and split-K count where the options fix them (tuning runs)."""
        o = self.options
        tiles, split_k = (o.moe_tiles, o.moe_split_k) if self.int4_group is None else (o.w4a16_tiles, o.w4a16_split_k)
        return {k: v for k, v in (("tiles", tiles), ("split_k", split_k)) if v is not None}

    def _stats(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens per expert of this forward, since the last reset), kept on the device for
        `kernels.moe_experts` to fill in place (no bincount, which asks the host for the max id),
        so the tensors keep their storage across steps and under CUDA-graph replay. The fill costs
        no launch where every expert is local (the routing launch writes them), one otherwise."""
        n = self.gate.cfg.n_routed_experts
        if self.last_expert_counts is None or self.last_expert_counts.device != ids.device:
            self.last_expert_counts = torch.zeros(n, dtype=torch.int64, device=ids.device)
            self.expert_counts_total = torch.zeros(n, dtype=torch.int64, device=ids.device)
        return self.last_expert_counts, self.expert_counts_total

    def reset_expert_counts(self) -> None:
        if self.expert_counts_total is not None:
            self.expert_counts_total.zero_()
