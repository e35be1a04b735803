"""DeepSeek-V3 / Kimi-K2 causal LM over the paged latent cache.

One forward computes N new rows per request with whatever mask the batch says (causal
chunk, single decode row, or a draft tree); there is no prefill/decode distinction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from treeflash.config import ModelConfig
from treeflash.models.layers import MLP, RMSNorm, Rotary
from treeflash.models.mla import MLA, AttnBatch
from treeflash.models.moe import MoE
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sharding import Parallel


class DecoderLayer(nn.Module):
    """Under tensor parallelism attention and MLP/MoE each return this rank's partial sum;
    one all-reduce after each makes the residual stream identical on every rank."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: Parallel | None = None,
                 options: RuntimeOptions = DEFAULT):
        super().__init__()
        par = self.parallel = parallel or Parallel()
        self.self_attn = MLA(cfg, par, options)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, par, layer=index, options=options)
        else:  # column-split gate/up, row-split down
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // par.tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)

    def forward(self, x, delta, cos_sin, rotary, kv_cache, batch: AttnBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta None: x itself); returns (the residual stream
        after attention, the MLP's output), whose sum is the layer's output: the next layer's
        input norm (or the final norm) adds them in its own launch, so no layer spends a launch
        on the add alone (H100, 2f3c521: -0.05 to -0.3 ms a kimi-k2-tp8 step)."""
        reduce = self.parallel.all_reduce
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_forward(delta, x)  # x += delta; h = norm(x)
        attn = reduce(self.self_attn(h, cos_sin, rotary, kv_cache, batch))
        h, x = self.post_attention_layernorm.add_forward(attn, x)  # x += attn; h = norm(x)
        return x, reduce(self.mlp(h))


class Backbone(nn.Module):
    """Named like the Hugging Face `model.` prefix so checkpoint names map one to one."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel | None = None, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, parallel, options) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)


class TargetModel(nn.Module):
    """`parallel` picks this rank's shard (default: the whole model in one process).
    Embedding and lm_head are replicated, so hidden states and logits are whole on rank 0.
    `options`: which implementation each fused step runs (`runtime.RuntimeOptions`)."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel | None = None, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.options = options
        self.parallel = parallel or Parallel()
        self.parallel.validate(cfg)
        self.model = Backbone(cfg, self.parallel, options)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave, options)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N] rotary positions (tree: start + depth)
        kv: torch.Tensor,  # [num_layers, num_pages, page_size, D]
        batch: AttnBatch,
        taps: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final normed hidden [B, N, hidden], taps [B, N, len(taps)*hidden] or None).

        Tap L is Hugging Face's `hidden_states[L+1]`, what the DFlash reference trains on: the
        output of decoder layer L, except for the last layer, whose entry transformers stores
        after the final norm (it is the final normed hidden).
        """
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        tapped: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        want = set(taps) - {last}
        delta = None  # the last layer's MLP output, not yet added to x (DecoderLayer.forward)
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, delta, cos_sin, self.rotary, kv[i], batch)
            if i in want:  # a tapped layer's output itself (the next norm adds it again: the same bits)
                tapped[i] = x if delta is None else x + delta
        final = self.model.norm(x) if delta is None else self.model.norm.add_forward(delta, x)[0]
        tapped[last] = final
        tap_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return final, tap_out

    def fuse_projections(self) -> int:
        """After the weights are in: each layer's kv_a / q_a projections as one GEMM
        (`MLA.fuse_a_projections`). Returns the layers fused."""
        return sum(layer.self_attn.fuse_a_projections() for layer in self.model.layers)

    def prepare_experts(self) -> int:
        """After the weights are in: a copy of every INT4 MoE layer's experts in humming-kernels'
        layout, or of none (`kernels/moe_w4a16/humming.py`'s `refusal`; one log line either way
        where there are INT4 layers). Returns the layers given one."""
        moes = [layer.mlp for layer in self.model.layers
                if isinstance(layer.mlp, MoE) and layer.mlp.int4_group is not None and layer.mlp.int4_copy is None]
        if not moes:  # (before the import: the INT4 kernels' package needs Triton, a plain model does not)
            return 0
        from treeflash.kernels.moe_w4a16 import humming

        why = humming.refusal([m.routed_weights() for m in moes])
        log = logging.getLogger(__name__)
        if why is not None:
            if moes:
                log.info("W4A16 MoE: our kernels at every row count (no humming-kernels copy: %s)", why)
            return 0
        dtype = self.model.embed_tokens.weight.dtype
        for m in moes:
            m.int4_copy = humming.HummingExperts(*m.routed_weights(), dtype)
        log.info("W4A16 MoE: %d layers hold a humming-kernels copy (run from 9 rows)", len(moes))
        return len(moes)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """lm_head(hidden) [..., V]: float32, or (float32=False) in the model's dtype for a
        caller that computes in float32 itself (token choice), saving the cast's launch."""
        out = self.lm_head(hidden)
        return out.float() if float32 else out

    def moe_expert_counts(self) -> list[torch.Tensor]:
        """Tokens routed to each expert in every MoE layer during the last forward.

        Routing is replicated, so every rank (rank 0 included) sees all E experts' counts.
        """
        return [
            layer.mlp.last_expert_counts
            for layer in self.model.layers
            if isinstance(layer.mlp, MoE) and layer.mlp.last_expert_counts is not None
        ]

    def moe_rank_counts(self) -> list[torch.Tensor]:
        """Token-expert pairs each expert-parallel group computed per MoE layer, [ep] each.

        With ep=1 (pure TP) every rank computes a slice of every pair: one entry, the total.
        """
        ep = self.parallel.ep_size
        return [c.view(ep, -1).sum(1) for c in self.moe_expert_counts()]
