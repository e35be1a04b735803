"""Memory a model needs, estimated from its config before anything is allocated, and what the
device has: so that a preset too big for this machine is refused with the figure (not a raw
allocation error minutes in), and so that `--mem-fraction-static` can size the KV pool.

Weights are counted exactly by building the model on PyTorch's meta device (no storage):
parameters in the model's dtype, INT4 routed experts as their packed words and scales; the
KV cache is layers x the cache's row a token (`kv_row_bytes`: the latent width in the model
dtype, or the 656-byte fp8_e4m3 row of `kvcache.format`); the workspace is the largest
transient tensors of a step: on the CPU the torch reference attention materialises its
scores, [rows, heads, keys] in float32 three times over and the gathered keys once; on a GPU
the kernels do not, and a fixed reserve covers the CUDA context, cuBLAS and the allocator's
slack. `memory_plan.py` lays the same figures out per GPU for a whole model under TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.config import DrafterConfig, ModelConfig

GIB = 1 << 30
GPU_RESERVE = 1 * GIB  # CUDA context, cuBLAS / Triton workspaces, caching-allocator slack
HOST_RESERVE = GIB // 4  # Python, torch, small temporaries


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a model pair needs on a device: weights, KV (target + drafter), step workspace."""

    parameters: int
    weights: int
    kv: int
    workspace: int
    dtype: torch.dtype
    kv_tokens: int
    int4_experts: bool = False  # routed experts stored INT4 (packed words + scales)
    kv_cache_dtype: str = "auto"

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.workspace

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        how = f"routed experts INT4, the rest in {dtype}" if self.int4_experts else f"in {dtype}"
        kv_note = f" in {self.kv_cache_dtype} rows" if self.kv_cache_dtype != "auto" else ""
        return (f"{gb(self.total)} (weights {gb(self.weights)} = {self.parameters / 1e9:.2f}G parameters {how}, "
                f"KV {gb(self.kv)} for {self.kv_tokens} tokens{kv_note}, workspace {gb(self.workspace)})")


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def meta_tensors(cfg: ModelConfig, dcfg: DrafterConfig | None = None, parallel=None):
    """(name, tensor, is_parameter) of the target (one rank's shard under `parallel`) and of the
    drafter (names prefixed "drafter."), built on the meta device: shapes and dtypes, no storage.
    Shared tensors (the drafter's view of the target's embedding and head) come once."""
    from treeflash.models.drafter import DFlashDrafter
    from treeflash.models.target import TargetModel

    with torch.device("meta"):
        model = TargetModel(cfg, parallel)
        modules = [("", model)]
        if dcfg is not None:
            modules.append(("drafter.", DFlashDrafter(dcfg, model.model.embed_tokens.weight, model.lm_head.weight)))
    seen = set()
    for prefix, m in modules:
        params = {id(p) for p in m.parameters()}
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                yield prefix + name, t, id(t) in params


def tensor_bytes(t: torch.Tensor, is_parameter: bool, dtype: torch.dtype) -> int:
    """Bytes `t` takes once built in `dtype`: parameters in that dtype, buffers (INT4 experts' packed
    int32 words and bf16 scales, float32 router biases) in their own."""
    return t.numel() * (dtype.itemsize if is_parameter else t.element_size())


def parameter_count(cfg: ModelConfig, dcfg: DrafterConfig | None = None) -> int:
    """Parameters of the target (and of the drafter, which shares its embedding and head); an
    INT4 expert stack counts its logical (unpacked) parameters."""
    from treeflash.kernels.int4 import PACK

    return sum(t.numel() * (PACK if name.endswith("_packed") else 1)
               for name, t, param in meta_tensors(cfg, dcfg) if param or name.endswith("_packed"))


def weight_bytes(cfg: ModelConfig, dcfg: DrafterConfig | None, dtype: torch.dtype, parallel=None) -> int:
    """Bytes of every tensor the built target (and drafter) hold, `tensor_bytes` each."""
    return sum(tensor_bytes(t, p, dtype) for _, t, p in meta_tensors(cfg, dcfg, parallel))


def kv_row_bytes(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's latent row (c_kv || k_pe) in one layer, in the cache's row format
    (`kvcache.format`: "auto" or the model dtype's name, the latent width in that dtype;
    "fp8_e4m3" and its spellings, 656 B at D 576). An unknown name is a ValueError naming the choices."""
    from treeflash.kvcache.format import kv_format

    return kv_format(kv_cache_dtype, cfg.latent_dim, cfg.kv_lora_rank, dtype).row_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, dcfg: DrafterConfig | None = None,
                       kv_cache_dtype: str = "auto") -> int:
    """The target's latent row (c_kv || k_pe) in every layer, plus the drafter's K and V in each of
    its full-attention layers (its sliding layers keep a fixed window: `drafter_window_bytes`,
    once a request)."""
    per = cfg.num_hidden_layers * kv_row_bytes(cfg, dtype, kv_cache_dtype)
    if dcfg is not None:
        full = sum(1 for i in range(dcfg.num_hidden_layers) if not dcfg.window(i))
        per += full * 2 * dcfg.num_key_value_heads * dcfg.head_dim * dtype.itemsize
    return per


def drafter_window_bytes(dcfg: DrafterConfig | None, dtype: torch.dtype) -> int:
    """A request's drafter cache in its sliding layers: a ring of W - 1 rows of K and V (and each
    slot's int64 position) a layer (`models/drafter.py` LayerKV), whatever the context."""
    if dcfg is None:
        return 0
    row = 2 * dcfg.num_key_value_heads * dcfg.head_dim * dtype.itemsize + 8
    return sum(max(w - 1, 0) * row for i in range(dcfg.num_hidden_layers) if (w := dcfg.window(i)))


def workspace_bytes(cfg: ModelConfig, rows: int, context: int, device: torch.device) -> int:
    """The largest transient tensors of a step of `rows` query rows over `context` keys."""
    logits = 2 * rows * cfg.vocab_size * 4
    if device.type == "cuda":
        return GPU_RESERVE + logits
    scores = 3 * rows * cfg.num_attention_heads * context * 4  # reference attention, float32
    gathered = context * cfg.latent_dim * 4
    return HOST_RESERVE + logits + scores + gathered


def plan(cfg: ModelConfig, dcfg: DrafterConfig | None, dtype: torch.dtype, device: torch.device,
         kv_tokens: int, rows: int, kv_cache_dtype: str = "auto") -> MemoryPlan:
    kv = kv_tokens * kv_bytes_per_token(cfg, dtype, dcfg, kv_cache_dtype) + drafter_window_bytes(dcfg, dtype)
    return MemoryPlan(parameter_count(cfg, dcfg), weight_bytes(cfg, dcfg, dtype), kv,
                      workspace_bytes(cfg, rows, kv_tokens, device), dtype, kv_tokens,
                      int4_experts=bool(cfg.int4_expert_layers), kv_cache_dtype=kv_cache_dtype)


def device_memory(device: torch.device) -> tuple[int, int, str]:
    """(free bytes, total bytes, what they are) on `device`: the GPU's, or the host's RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, total, f"free on {torch.cuda.get_device_name(device)}"
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total, "available CPU RAM"


def check_fits(need: MemoryPlan, device: torch.device, what: str, alternatives: list[str]) -> None:
    """ValueError naming the figure and the alternatives when `need` exceeds what `device` has free."""
    free, _, where = device_memory(device)
    if need.total <= free:
        return
    alt = "; ".join(alternatives) if alternatives else "a machine with more memory"
    raise ValueError(f"{what} needs about {need.describe()}, more than the {gb(free)} {where}. Instead: {alt}")


def kv_tokens_for_fraction(fraction: float, weights: int, bytes_per_token: int, rows: int, cfg: ModelConfig,
                           device: torch.device, context: int) -> tuple[int, str]:
    """KV tokens that fit when weights + KV + workspace may use `fraction` of the device's total
    memory (vLLM's --gpu-memory-utilization, SGLang's --mem-fraction-static), and the sum shown.
    The workspace is that of `rows` rows over `context` keys (a prefill chunk at max_model_len)."""
    _, total, where = device_memory(device)
    budget = int(fraction * total)
    work = workspace_bytes(cfg, rows, context, device)
    room = budget - weights - work
    tokens = max(room, 0) // bytes_per_token
    how = (f"{fraction:g} x {gb(total)} ({where.removeprefix('free on ').removeprefix('available ')}) = "
           f"{gb(budget)}, less weights {gb(weights)} and workspace {gb(work)}")
    return tokens, how
