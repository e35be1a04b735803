"""What `bench sweep` and `doctor` run on: a target + drafter pair and engines around it.

Presets are random-weight models at real geometry, built on the device with no checkpoint
(the real ones cannot be downloaded here). They keep a few layers; `full_layers` says how
many the real model has, and the sweep extrapolates per-layer figures to it and says so.
Random weights accept nothing, so preset runs take their acceptance from a declared source
(`DeclaredDrafter`: the real drafter's compute, the oracle's proposals).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeflash.bench import published
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.engine.engine import Engine
from treeflash.kernels import int4
from treeflash.kvcache import KVFormat, KVPool, kv_format
from treeflash.kvcache.coarse import whole_tiles
from treeflash.kvcache.pool import scratch_tokens
from treeflash.models.drafter import DFlashDrafter
from treeflash.models.layers import set_options
from treeflash.models.target import TargetModel
from treeflash.runtime import RuntimeOptions
from treeflash.sharding import Parallel
from treeflash.speculative.decoder import SpecDecoder
from treeflash.speculative.testing_drafters import MARGIN

PREFILL_CHUNK = 512  # the rigs' engines prefill in chunks of this many rows (Engine's default)


@dataclass(frozen=True)
class Preset:
    name: str
    target: dict  # Hugging Face config.json fields
    drafter: dict  # z-lab DFlash config.json fields (dflash_config inside)
    full_layers: int  # layers of the real model; per-layer figures extrapolate to this
    full_dense_layers: int  # of which dense (the rest MoE)
    tp: int  # ranks the real model is split over (1 = whole model on one GPU)
    notes: str
    # the real model's config.json and its drafter's (what `doctor --memory-plan` plans);
    # None: the preset's own at its full depth
    full_target: dict | None = None
    full_drafter: dict | None = None


def _k2_target(heads: int, experts: int, moe_inter: int, dense_inter: int, vocab: int, layers: int) -> dict:
    return published.kimi_k2_text(layers, heads, experts, moe_inter, dense_inter, vocab)


def _drafter(hidden: int, heads: int, kv_heads: int, inter: int, taps: Sequence[int], vocab: int,
             layers: int = 5, window: int = 2048, block: int = 16, max_pos: int = 262144) -> dict:
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=128, intermediate_size=inter, vocab_size=vocab,
        rms_norm_eps=1e-6, max_position_embeddings=max_pos, rope_theta=1e6, layer_types=types,
        sliding_window=window, use_sliding_window=True, block_size=block,
        dflash_config=dict(target_layer_ids=list(taps), mask_token_id=vocab - 1),
    )


def _taps(full: Sequence[int], full_layers: int, layers: int) -> list[int]:
    """The real drafter's tap layers mapped onto the kept layers (same count, same spread)."""
    return [round(t * (layers - 1) / (full_layers - 1)) for t in full]


def tp_slice(text: dict, drafter: dict, tp: int, layers: int) -> tuple[dict, dict]:
    """One GPU's share of a published (target text config, drafter config) pair under TP `tp`,
    `layers` target layers kept: attention heads, the dense / routed / shared intermediate dims
    and the vocabulary (embedding and head vocab-parallel) split `tp` ways, the quantization
    kept; token ids of the full vocabulary (special tokens, the drafter's mask) become their
    row in the shard that holds them (id mod V/tp). The drafter stays whole, as a tensor-parallel
    run holds it (on rank 0: `parallel/__init__.py`), reading that vocabulary shard; its taps map
    onto the kept layers as `_taps` spreads them."""
    shard = text["vocab_size"] // tp
    target = dict(text, num_hidden_layers=layers, vocab_size=shard,
                  num_attention_heads=text["num_attention_heads"] // tp,
                  num_key_value_heads=text["num_attention_heads"] // tp,
                  intermediate_size=text["intermediate_size"] // tp,
                  moe_intermediate_size=text["moe_intermediate_size"] // tp)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(text.get(key), int):
            target[key] = text[key] % shard
    dflash = drafter["dflash_config"]
    full_layers = drafter.get("num_target_layers") or text["num_hidden_layers"]
    draft = dict(drafter, vocab_size=shard, num_target_layers=layers,
                 dflash_config=dict(dflash, target_layer_ids=_taps(dflash["target_layer_ids"], full_layers, layers),
                                    mask_token_id=dflash["mask_token_id"] % shard))
    return target, draft


K2_TAPS = (1, 15, 30, 45, 59)  # 5 taps spread over Kimi K2's 61 layers (DFlash's usual spread)
_TP8_VOCAB = 163840 // 8
DEFAULT_PRESET = "kimi-k2.6-tp8"  # `bench sweep --preset` and `doctor --preset` without a name
_TINY_TARGET = dict(
    model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    first_k_dense_replace=1, max_position_embeddings=16384, routed_scaling_factor=2.5, eos_token_id=1,
    bos_token_id=0)
_K26_TP8 = tp_slice(published.K26_TEXT | {"quantization_config": published.int4_quantization()},
                    published.K26_DFLASH, tp=8, layers=4)
_TINY_K26 = tp_slice(  # the same construction at tiny size: INT4 experts (group 32), a K2.6-shaped drafter
    _TINY_TARGET | {"quantization_config": published.int4_quantization()},
    published.k26_dflash(hidden=64, heads=4, kv_heads=1, head_dim=16, inter=96, vocab=128, mask=126, window=32,
                         max_pos=16384, rope=dict(published.K26_YARN, factor=4.0)),
    tp=1, layers=3)

PRESETS: dict[str, Preset] = {
    "kimi-k2.6-tp8": Preset(
        "kimi-k2.6-tp8", *_K26_TP8, full_layers=61, full_dense_layers=1, tp=8,
        notes="per-GPU slice of Kimi K2.6 as published under TP8: 8 of 64 query heads, latent 512+64, hidden "
              "7168, all 384 routed experts INT4 (compressed-tensors pack-quantized, group 32, bf16 scales, "
              "random values) with intermediate 2048/8, dense/shared MLPs 1/8 in bf16, vocab-parallel "
              "embedding/head (1/8 of 163840 rows); the K2.6 DFlash drafter whole (6 layers, 64 query / 8 KV "
              "heads of 128, block 8, window 4096, taps 1/12/24/35/47/58 -> 0/1/1/2/2/3, mask token 163838 "
              "-> row 20478 of the last shard, YaRN over the full head dim), as a TP run holds it on rank 0; "
              "4 of 61 layers kept (1 dense + 3 MoE), per-layer figures extrapolated to 61; "
              "the TP all-reduces are not modelled",
        full_target=published.K26_CONFIG, full_drafter=published.K26_DFLASH,
    ),
    "kimi-k2-tp8": Preset(
        "kimi-k2-tp8",
        _k2_target(heads=8, experts=384, moe_inter=2048 // 8, dense_inter=18432 // 8,
                   vocab=_TP8_VOCAB, layers=4),
        _drafter(7168, heads=4, kv_heads=1, inter=18432 // 8, taps=_taps(K2_TAPS, 61, 4), vocab=_TP8_VOCAB),
        full_layers=61, full_dense_layers=1, tp=8,
        notes="per-GPU slice of Kimi K2 under TP8: 8 of 64 query heads, latent 512+64, hidden 7168, "
              "all 384 experts with intermediate 2048/8 (TP-sharded experts), dense/shared MLPs 1/8, "
              "vocab-parallel embedding/head (1/8 of 163840 rows), drafter sharded the same way; "
              "4 of 61 layers kept (1 dense + 3 MoE), per-layer figures extrapolated to 61; "
              "the TP all-reduces are not modelled",
        full_target=_k2_target(heads=64, experts=384, moe_inter=2048, dense_inter=18432, vocab=163840, layers=61),
        full_drafter=_drafter(7168, heads=32, kv_heads=8, inter=18432, taps=K2_TAPS, vocab=163840),
    ),
    "kimi-k2": Preset(
        "kimi-k2",
        _k2_target(heads=64, experts=48, moe_inter=2048, dense_inter=18432, vocab=163840, layers=4),
        _drafter(7168, heads=32, kv_heads=8, inter=18432, taps=_taps(K2_TAPS, 61, 4), vocab=163840),
        full_layers=61, full_dense_layers=1, tp=1,
        notes="Kimi K2 geometry with all 64 heads on one GPU; 48 of 384 experts (top-8) and 4 of 61 "
              "layers kept so it fits; per-layer figures extrapolated to 61 layers",
    ),
    "deepseek-v3": Preset(
        "deepseek-v3",
        dict(_k2_target(heads=128, experts=32, moe_inter=2048, dense_inter=18432, vocab=129280, layers=5),
             model_type="deepseek_v3", n_group=8, topk_group=4, first_k_dense_replace=3,
             routed_scaling_factor=2.5, max_position_embeddings=163840, rope_theta=10000.0,
             rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
        _drafter(7168, heads=32, kv_heads=8, inter=18432, taps=_taps((1, 15, 30, 45, 59), 61, 5),
                 vocab=129280, max_pos=163840),
        full_layers=61, full_dense_layers=3, tp=1,
        notes="DeepSeek-V3 geometry with all 128 heads on one GPU; 32 of 256 experts (top-8, 8 groups) "
              "and 5 of 61 layers kept (3 dense + 2 MoE); per-layer figures extrapolated to 61 layers",
    ),
    "tiny": Preset(
        "tiny", _TINY_TARGET,
        _drafter(64, heads=4, kv_heads=2, inter=96, taps=(0, 2), vocab=128, layers=2, window=32,
                 block=6, max_pos=16384) | {"head_dim": 16},
        full_layers=3, full_dense_layers=1, tp=1,
        notes="tiny random model for CPU tests (all layers kept)",
    ),
    "tiny-int4": Preset(
        "tiny-int4", *_TINY_K26, full_layers=3, full_dense_layers=1, tp=1,
        notes="tiny random model for CPU tests, built as kimi-k2.6-tp8 is: routed experts INT4 (group 32), a "
              "K2.6-shaped drafter (6 layers, GQA 4:1, block 8, taps 1/12/24/35/47/58 -> 0/0/1/1/2/2, "
              "window 32, YaRN over the full head dim)",
    ),
}


# ---- memory, before building ----------------------------------------------------------
def verify_rows(tree_budget) -> int:
    """Rows of the widest step a sweep or doctor runs: a tree and its root (auto's largest bucket,
    speculative/budget.py). A list (bench sweep's budget table): the widest of them."""
    from treeflash.speculative.budget import BUCKETS
    from treeflash.speculative.decoder import DEFAULT_TREE_BUDGET

    if isinstance(tree_budget, (list, tuple)):
        return max((verify_rows(b) for b in tree_budget), default=verify_rows(None))
    if tree_budget == "auto":
        return max(BUCKETS) + 1
    return (tree_budget if isinstance(tree_budget, int) else DEFAULT_TREE_BUDGET) + 1


def preset_memory(name: str, device: torch.device, dtype: torch.dtype, context: int, rows: int = 128,
                  kv_cache_dtype: str = "auto"):
    """`memory.MemoryPlan` of preset `name` (target + drafter) holding one request of `context`
    tokens, verifying `rows` rows a step, its latent cache in `kv_cache_dtype`'s rows."""
    from treeflash import memory

    preset = PRESETS[name]
    cfg, dcfg = ModelConfig.from_hf(preset.target), DrafterConfig.from_hf(preset.drafter)
    return memory.plan(cfg, dcfg, dtype, device, context + rows, rows, kv_cache_dtype)


def preset_fits(name: str, device: torch.device, dtype: torch.dtype, context: int, rows: int = 128,
                kv_cache_dtype: str = "auto") -> bool:
    from treeflash.memory import device_memory

    return preset_memory(name, device, dtype, context, rows, kv_cache_dtype).total <= device_memory(device)[0]


def check_preset_fits(name: str, device: torch.device, dtype: torch.dtype, context: int,
                      tree_budget: int | str | list | None = None, kv_cache_dtype: str = "auto") -> None:
    """ValueError with the estimate and what would fit instead, when preset `name` at `context` needs
    more memory than `device` has free (it was a raw allocation error minutes into the build);
    the KV counted in `kv_cache_dtype`'s rows."""
    from treeflash import memory
    from treeflash.kvcache.format import FP8, parse_kv_cache_dtype

    kind = parse_kv_cache_dtype(kv_cache_dtype, dtype)
    rows = verify_rows(tree_budget)
    need = preset_memory(name, device, dtype, context, rows, kind)
    free = memory.device_memory(device)[0]
    if need.total <= free:
        return
    alternatives = []
    if dtype == torch.float32:
        half = preset_memory(name, device, torch.bfloat16, context, rows, kind)
        if half.total <= free:
            alternatives.append(f"--dtype bfloat16 (about {memory.gb(half.total)})")
    if kind != FP8 and (fp8 := preset_memory(name, device, dtype, context, rows, FP8)).total <= free:
        alternatives.append(f"--kv-cache-dtype fp8_e4m3 (about {memory.gb(fp8.total)})")
    int4 = {p: "quantization_config" in PRESETS[p].target for p in PRESETS}  # its twin first: same experts
    smaller = [p for p in sorted(PRESETS, key=lambda p: int4[p] != int4[name])
               if p != name and preset_fits(p, device, dtype, min(context, 4096), rows, kind)]
    alternatives += [f"--preset {p} --contexts 1k,4k" for p in smaller[:1]]
    alternatives.append(f"a {'GPU' if device.type == 'cpu' else 'device'} with more than {memory.gb(need.total)} free")
    memory.check_fits(need, device, f"preset {name} at {context} tokens", alternatives)


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype):
    """Allocate parameters straight on the device in the target dtype (no fp32 host copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def random_init(module: torch.nn.Module, seed: int) -> None:
    """Norms 1, embeddings N(0, 1), every matrix N(0, 1/fan_in): activations stay O(1)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif "embed" in name:
            p.normal_(0.0, 1.0, generator=g)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    for m in module.modules():  # INT4 routed experts are buffers, not parameters
        if getattr(m, "expert_format", None) == "int4":
            for w in m.routed_weights():
                int4.random_fill_(w, w.shape[-1] ** -0.5, g)


def build_preset(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, dcp_model: int = 1,
                 max_positions: int | None = None):
    """(TargetModel, DFlashDrafter, Preset) with random weights, built on `device`; dcp_model > 1:
    the target is one rank of a modelled DCP group of that size (`models/dcp.py`); max_positions:
    the target's max_position_embeddings raised to it (a cost model past the trained context)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    preset = PRESETS[name]
    cfg = ModelConfig.from_hf(preset.target)
    if max_positions is not None:
        cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_positions))
    dcfg = DrafterConfig.from_hf(preset.drafter)
    dcfg.check_fits(cfg)
    with _building(device, dtype):
        model = TargetModel(cfg, Parallel(dcp_size=dcp_model) if dcp_model > 1 else None)
    random_init(model, seed)
    with _building(device, dtype):
        drafter = DFlashDrafter(dcfg, model.model.embed_tokens.weight, model.lm_head.weight)
    random_init(drafter, seed + 1)
    plant_greedy_chain(model)
    for layer in model.model.layers:  # as the loader keeps them: float32 (a 16-bit one is cast every call)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    model.fuse_projections()
    model.prepare_experts()
    return model.eval(), drafter.eval(), preset


@torch.no_grad()
def plant_greedy_chain(model: TargetModel, scale: float = 64.0) -> None:
    """Make the random target's greedy continuation t -> t+1 (mod vocab), by a wide margin.

    With plain random weights the logits are nearly flat, so bf16 rounding that differs
    between a one-row decode and a 33-row verify flips the argmax within a few tokens and a
    declared ("oracle") acceptance measured against the decode's continuation collapses to
    1.00 on the GPU. Here the embedding is scaled up so that it dominates the residual
    stream (every layer still reads a normalised input, so attention and MoE do the same
    work and route the same way as before), and lm_head row t+1 is the direction the final
    norm gives token t: its logit is ~sqrt(hidden) while every other is ~N(0, 1).
    Shapes, dtypes and bytes are unchanged, so step times are those of random weights.
    """
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if head.data_ptr() == emb.data_ptr():
        return  # tied: no separate head to plant (no preset is tied)
    emb.mul_(scale)
    g = model.model.norm.weight.float()
    rows = torch.nn.functional.normalize(emb.float() * g, dim=-1)  # final-norm direction of token t
    head.copy_(torch.roll(rows, shifts=1, dims=0).to(head.dtype))  # row t+1 <- token t


# ---- declared acceptance --------------------------------------------------------------
class DeclaredDrafter:
    """A real drafter's compute with declared proposals.

    propose/extend run the wrapped drafter (so the step pays its true cost), then the
    proposals are replaced by the target's own continuation (`reference`, one list per
    request, token at position `offset + i`) for the first `accept` depths (None = all)
    and a token the target will not pick after that. With an exact reference the mean
    acceptance length is accept + 1; the sweep reports the measured value next to it.
    """

    def __init__(self, inner, reference: Sequence[int], offset: int, accept: int | None = None):
        self.inner, self.reference, self.offset, self.accept = inner, list(reference), offset, accept
        self.block_size, self.mask_token_id = inner.block_size, inner.mask_token_id
        self.target_layer_ids, self.vocab_size = inner.target_layer_ids, inner.vocab_size
        self._ref: torch.Tensor | None = None  # the reference on the drafter's device, + a 0 pad
        self._noise: torch.Tensor | None = None

    def new_cache(self, prompt_ids=None):
        return self.inner.new_cache(prompt_ids)

    def release_cache(self, cache) -> None:
        if hasattr(self.inner, "release_cache"):
            self.inner.release_cache(cache)

    def extend(self, cache, features, positions=None) -> None:
        self.inner.extend(cache, features, positions)

    def extend_static(self, cache, features, start, first, count=None) -> None:
        self.inner.extend_static(cache, features, start, first, count)

    @property
    def supports_static_propose(self) -> bool:
        return getattr(self.inner, "supports_static_propose", False)

    def propose(self, caches, bonus, start_pos, block_size=None, static: bool = False,
                full: bool = False) -> torch.Tensor:
        kw = {"static": True} if static else {"full": True} if full else {}
        real = self.inner.propose(caches, bonus, start_pos, block_size, **kw)  # [B, D, V]: its cost
        device = real.device
        if self._ref is None or self._ref.device != device:
            self._ref = torch.tensor(self.reference + [0], dtype=torch.long, device=device)
        depth = real.shape[1]
        # Built on the device from a device copy of the reference: no host sync in the step.
        i = start_pos.to(device).long()[:, None] + torch.arange(1, depth + 1, device=device) - self.offset
        valid = (i >= 0) & (i < len(self.reference))
        tok = self._ref[torch.where(valid, i, len(self.reference))]  # out of range -> token 0
        right = depth if self.accept is None else self.accept
        good = (torch.arange(depth, device=device) < right)[None, :].expand_as(tok)
        if self._noise is None or self._noise.device != device or self._noise.shape[0] < real.shape[0] \
                or self._noise.shape[1] != depth:
            g = torch.Generator(device=device).manual_seed(1234)
            self._noise = torch.randn(max(8, real.shape[0]), depth, self.vocab_size, device=device, generator=g)
        # Unit noise under the declared token: the other branches of a tree are distinct
        # random tokens (so they route to experts like real siblings would), never the same
        # few lowest ids that all-zero logits would tie-break to. Drawn once (a fixed buffer
        # is also what a CUDA graph can replay).
        out = self._noise[: real.shape[0]].clone()
        # right depths: the reference token; the rest: a confident wrong token, the right one impossible
        out.scatter_(2, torch.where(good, tok, (tok + 1) % self.vocab_size)[..., None], MARGIN)
        out.scatter_(2, tok[..., None], torch.where(good, MARGIN, float("-inf"))[..., None].to(out.dtype))
        return out


# ---- the rig: a model pair and engines around it ------------------------------------------
@dataclass
class Rig:
    """A target, its drafter (or None) and how to build engines on them.

    Tests swap parts (a broken drafter, a miscounting decoder, a scattered pool) to check
    that `doctor` names the fault.
    """

    model: TargetModel
    drafter: object | None
    device: torch.device
    dtype: torch.dtype
    page_size: int = 64
    scattered: bool = False
    tree_budget: int | None = None
    preset: Preset | None = None
    source: str = ""
    tokenizer: object | None = None
    decoder_factory: Callable[..., SpecDecoder] = SpecDecoder
    extra: dict = field(default_factory=dict)
    cuda_graphs: bool = False  # engines replay CUDA graphs of decode/verify (see Engine)
    kv_cache_dtype: str = "auto"  # the engines' KV row format: auto or fp8_e4m3 (`kvcache.format`)
    dist: object | None = None  # DistContext of a tensor-parallel group (rank 0), None for one process
    _executor: object | None = None  # the last DistributedExecutor (they share the group)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def decoder(self, mode: str, drafter=None, budget=None) -> SpecDecoder | None:
        """budget: the ddtree node budget (an int or "auto"), None: the rig's."""
        if mode == "off":
            return None
        drafter = drafter or self.drafter
        if drafter is None:
            raise ValueError(f"spec {mode!r} needs a drafter")
        return self.decoder_factory(drafter, mode, self.tree_budget if budget is None else budget,
                                    options=self.model.options)

    def engine(self, mode: str, kv_tokens: int, drafter=None, pool: KVPool | None = None,
               max_running: int = 1, budget=None) -> Engine:
        """kv_tokens: KV per request (times max_running in the pool); budget: as decoder()'s."""
        spec = self.decoder(mode, drafter, budget)
        width = spec.verify_width if spec else 1
        if pool is None:  # + the scratch pages graphs reserve for padding rows; whole coarse pages
            # where pages are smaller than a tile, so that every request reads coarse (kvcache.coarse)
            page = self.page_size
            scratch = whole_tiles(width, page) + page if self.cuda_graphs else 0
            dcp_rows = scratch_tokens(max(width, PREFILL_CHUNK), page, self.dcp)  # DCP's scratch rows (else 0)
            pool = self.pool(max_running * (whole_tiles(kv_tokens + width + page, page) + dcp_rows) + scratch)
        max_len = max(kv_tokens + width, self.cfg.max_position_embeddings)
        executor = None
        if self.dist is not None:  # the followers rebuild their pool to this one's geometry
            from treeflash.engine.executor import LocalExecutor
            from treeflash.parallel.executor import DistributedExecutor

            executor = self._executor = DistributedExecutor(LocalExecutor(self.model, pool), self.dist)
        return Engine(self.model, pool, self.tokenizer, max_model_len=max_len, max_running=max_running, spec=spec,
                      cuda_graphs=self.cuda_graphs, executor=executor, prefill_chunk=PREFILL_CHUNK)

    def close(self) -> None:
        """Stop the tensor-parallel followers (no-op on one process)."""
        if self.dist is None:
            return
        if self._executor is not None:
            self._executor.shutdown()
        else:
            self.dist.abort()
        self.dist = None

    @property
    def dcp(self) -> int:
        """Decode context parallelism: the real group's (`dist`), or the one a preset models."""
        return self.model.parallel.dcp_size

    @property
    def kv_format(self) -> KVFormat:
        """The engines' KV row format (`kvcache.format`)."""
        return kv_format(self.kv_cache_dtype, self.cfg.latent_dim, self.cfg.kv_lora_rank, self.dtype)

    def pool(self, tokens: int) -> KVPool:
        """A pool for `tokens` of requests' context (a rank's 1/dcp share of it under DCP)."""
        span = self.page_size * self.dcp
        return KVPool(self.cfg.num_hidden_layers, -(-tokens // span), self.page_size,
                      self.cfg.latent_dim, self.dtype, self.device, scattered=self.scattered,
                      kv_cache_dtype=self.kv_cache_dtype, v_dim=self.cfg.kv_lora_rank, dcp=self.dcp)


def load_rig(model: str | None, drafter: str | None, preset: str | None, device: torch.device,
             dtype: torch.dtype, page_size: int = 64, scattered: bool = False,
             tree_budget: int | None = None, seed: int = 0, tp: int = 1, ep: int = 1,
             kv_cache_dtype: str = "auto", options: RuntimeOptions | None = None, dcp: int = 1,
             dcp_model: int = 1, max_positions: int | None = None) -> Rig:
    """A preset (random weights), or a checkpoint pair (default: the embedded pair).

    tp/ep > 1 (checkpoints only) start a tensor-parallel group: this process is rank 0 and
    its engines run through `DistributedExecutor`; call `Rig.close()` when done.
    kv_cache_dtype: the engines' KV rows, auto or fp8_e4m3 (`Rig.kv_cache_dtype`; may be changed
    between runs). options: the target's and drafter's runtime options (every rank's; default:
    the measured fastest). dcp: decode context parallelism inside that group. dcp_model (presets):
    one rank of a DCP group of that size, modelled on this device (`models/dcp.py`: its share of
    the cache, the group's heads, the merge; the collectives' wire time is the caller's to add)."""
    from treeflash.kvcache.format import parse_kv_cache_dtype

    kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, dtype)  # refused before building
    options = options or RuntimeOptions()
    if preset is not None:
        if model is not None:
            raise ValueError("give --preset or --model, not both")
        if tp != 1 or ep != 1 or dcp != 1:
            raise ValueError(f"preset {preset!r} is one GPU's slice with random weights: --tp/--ep/--dcp need a "
                             "checkpoint (--model, or the embedded pair); kimi-k2.6-tp8 and kimi-k2-tp8 model a "
                             "TP8 slice, --dcp-model N one rank of a DCP group of N")
        target, draft, p = build_preset(preset, device, dtype, seed, dcp_model, max_positions)
        set_options(target, options)
        set_options(draft, options)
        return Rig(target, draft, device, dtype, page_size, scattered, tree_budget, preset=p,
                   source=f"preset {preset} (random weights)", kv_cache_dtype=kv_cache_dtype)
    from treeflash.engine.llm import EMBEDDED, default_model_path, start_tensor_parallel
    from treeflash.engine.tokenizer import Tokenizer
    from treeflash.models.loader import load_target
    from treeflash.speculative.decoder import make_spec_decoder

    path = Path(model) if model is not None else default_model_path()
    if drafter is None and model is None and (EMBEDDED / "drafter" / "config.json").is_file():
        drafter = str(EMBEDDED / "drafter")
    if dcp_model != 1:
        raise ValueError("--dcp-model models one rank of a DCP group on a preset; a checkpoint runs the real "
                         "group: --tp N --dcp M")
    ctx = start_tensor_parallel(path, tp, ep, device, dtype, None, options, dcp)
    try:
        if ctx is not None:
            device = ctx.device
        target = load_target(path, device, dtype, ctx.parallel if ctx is not None else None, options)
        draft = None
        if drafter is not None:
            draft = make_spec_decoder(target, drafter, "ddtree", tree_budget, device, dtype, options).drafter
            set_options(draft, options)
        eos = target.cfg.eos_token_ids[0] if target.cfg.eos_token_ids else None
        tok = Tokenizer.from_model_dir(path, eos)
    except BaseException:
        if ctx is not None:
            ctx.abort()
        raise
    tp_note = f" (tp {tp}, ep {ep}" + (f", dcp {dcp})" if dcp > 1 else ")") if ctx is not None else ""
    return Rig(target, draft, device, dtype, page_size, scattered, tree_budget,
               source=f"{path}" + (f" + {drafter}" if drafter else "") + tp_note, tokenizer=tok, dist=ctx,
               kv_cache_dtype=kv_cache_dtype)
