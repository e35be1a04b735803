"""Train the embedded target: a small DeepSeek-V3 (MLA + MoE) causal LM on Python source.

The model is Hugging Face `transformers.DeepseekV3ForCausalLM`, so the checkpoint is the
public HF format (per-expert tensor names, `e_score_correction_bias`, YaRN in
`rope_parameters`) that treeflash's loader reads and the parity tests compare against.
Routing is sigmoid + noaux_tc; the correction bias is trained the DeepSeek-V3 way
(auxiliary-loss-free balancing: after each step, nudge each expert's bias by +-rate
toward the mean load).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .corpus import TokenData, fixed_windows, sample_windows
from .loop import (
    RngStates,
    TrainingInterrupted,
    backward_checked,
    check_lr,
    check_seq_len,
    checkpoint_path,
    ctrl_c_deferred,
    lr_at,
    make_optimizer,
    prepare_out_dir,
    read_checkpoint,
    resolve_device,
    restore_checkpoint,
    save_checkpoint,
    seed_everything,
    staged_files,
)
from .tokenizer import SpecialIds, load_tokenizer, special_ids


@dataclass(frozen=True)
class TargetShape:
    """Architecture sizes; names follow DeepseekV3Config."""

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    rope_theta: float
    yarn_factor: float
    original_max_position_embeddings: int

    @property
    def max_position_embeddings(self) -> int:
        """Positions the model is built for: the training context stretched by YaRN."""
        return int(self.original_max_position_embeddings * self.yarn_factor)


TARGET_PRESETS: dict[str, TargetShape] = {
    # The shipped model: ~6.9M parameters (13.7 MB in bf16) with a 4096 vocabulary.
    "small": TargetShape(
        hidden_size=256, intermediate_size=768, moe_intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, rope_theta=10000.0, yarn_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    # CPU smoke tests: seconds per step, same code paths (MLA, MoE, group routing, YaRN).
    "tiny": TargetShape(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, rope_theta=10000.0, yarn_factor=4.0,
        original_max_position_embeddings=64,
    ),
}


def target_config(shape: TargetShape, vocab_size: int, ids: SpecialIds):
    """The DeepseekV3Config for `shape`, with YaRN as DeepSeek-V3 writes it (mscale = mscale_all_dim = 1)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=shape.q_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        n_routed_experts=shape.n_routed_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        n_shared_experts=shape.n_shared_experts,
        n_group=shape.n_group,
        topk_group=shape.topk_group,
        first_k_dense_replace=shape.first_k_dense_replace,
        routed_scaling_factor=shape.routed_scaling_factor,
        norm_topk_prob=True,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": shape.rope_theta,
            "factor": shape.yarn_factor,
            "original_max_position_embeddings": shape.original_max_position_embeddings,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        bos_token_id=ids.bos,
        eos_token_id=ids.eos,
        pad_token_id=ids.pad,
    )


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- training ----------------------------------------------------------------------


@dataclass
class TargetTrainArgs:
    data: str
    out: str
    preset: str = "small"
    seq_len: int = 8192
    batch_size: int = 8
    steps: int = 100_000
    time_budget: float | None = None  # seconds; the LR schedule ends at whichever comes first
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    eval_every: int = 200
    eval_batches: int = 8
    save_every: int = 500
    seed: int = 0
    device: str = "auto"
    resume: bool = False
    progress: bool = True

    def validate(self) -> None:
        if self.preset not in TARGET_PRESETS:
            raise ValueError(f"--preset must be one of {sorted(TARGET_PRESETS)}, got {self.preset!r}")
        for name in ("seq_len", "batch_size", "steps", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        check_seq_len(self.seq_len, TARGET_PRESETS[self.preset].max_position_embeddings,
                      f"the {self.preset} target's")
        if self.time_budget is not None and not self.time_budget > 0:  # nan too: it would never stop the run
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        check_lr(self.lr, self.min_lr_ratio)
        if not 0 <= self.seed < 2**64:  # numpy's and torch's seed range
            raise ValueError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("--warmup-steps and --weight-decay must be >= 0, --grad-clip > 0")


class ExpertBalancer:
    """DeepSeek-V3 auxiliary-loss-free balancing of `e_score_correction_bias`."""

    def __init__(self, model: torch.nn.Module, rate: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module, inputs, output) -> None:
        if not module.training:
            return
        idx = output[2].flatten()
        c = torch.bincount(idx, minlength=module.num_experts).float()
        key = id(module)
        self.counts[key] = c if key not in self.counts else self.counts[key] + c

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; returns the worst max/mean load ratio seen this step."""
        worst = 1.0
        for r in self.routers:
            c = self.counts.pop(id(r), None)
            if c is None:
                continue
            mean = c.mean()
            r.e_score_correction_bias.add_(self.rate * torch.sign(mean - c))
            worst = max(worst, float(c.max() / mean.clamp_min(1)))
        return worst


def lm_loss(model, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Next-token cross entropy on a [B, T+1] window batch."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


@torch.no_grad()
def heldout_loss(model, windows: np.ndarray, device: torch.device, batch_size: int = 4) -> float:
    """Mean next-token loss (nats) over fixed held-out windows."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = torch.from_numpy(windows[i : i + batch_size]).to(device)
        total += float(lm_loss(model, b, device)) * len(b)
        n += len(b)
    model.train(was_training)
    return total / max(1, n)


def export_hf(model, out: Path, tokenizer_dir: Path | None, dtype=torch.bfloat16) -> None:
    """Write config.json + model.safetensors (+ tokenizer) in the Hugging Face format.

    Weights are stored in `dtype`; the router weight and correction bias stay fp32 (HF
    keeps them fp32 on load anyway, and they are tiny).
    """
    import copy

    from transformers import GenerationConfig

    export = copy.deepcopy(model).to("cpu")
    for name, p in export.named_parameters():
        if ".mlp.gate." not in name:
            p.data = p.data.to(dtype)
    export.config.dtype = str(dtype).removeprefix("torch.")
    cfg = export.config
    export.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        do_sample=False,
    )
    with staged_files(out) as tmp:
        export.save_pretrained(tmp)
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    (tmp / name).write_bytes(src.read_bytes())


def build_model(args: TargetTrainArgs, vocab_size: int, ids: SpecialIds):
    from transformers import DeepseekV3ForCausalLM

    cfg = target_config(TARGET_PRESETS[args.preset], vocab_size, ids)
    cfg._attn_implementation = "sdpa"
    return DeepseekV3ForCausalLM(cfg)


def train_target(args: TargetTrainArgs, log=print) -> dict:
    """Train (or resume) the target; returns the final metrics dict (also in OUT/metrics.json)."""
    from tqdm.auto import tqdm

    args.validate()
    device = resolve_device(args.device)
    data = TokenData.load(args.data)
    tok = load_tokenizer(data.tokenizer_path)
    ids = special_ids(tok)
    out = prepare_out_dir(args.out)
    seed_everything(args.seed)
    model = build_model(args, tok.get_vocab_size(), ids).to(device)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    rng = np.random.default_rng(args.seed)
    step, elapsed, history = 0, 0.0, []
    if args.resume:
        step, elapsed, history = _resume(out, model, opt, rng, args, log)
    elif checkpoint_path(out).exists():
        raise ValueError(f"{checkpoint_path(out)} exists: pass --resume to continue it, or choose another --out")
    balancer = ExpertBalancer(model, args.bias_update_rate)
    eval_windows = fixed_windows(data.heldout, args.eval_batches, args.seq_len + 1)
    n_params = count_parameters(model)
    log(f"target: {n_params / 1e6:.2f}M parameters, preset {args.preset}, device {device}")
    model.train()
    t_start = time.time() - elapsed
    bar = tqdm(total=args.steps, initial=step, disable=not args.progress, desc="target", dynamic_ncols=True)
    tokens_per_step = args.batch_size * args.seq_len
    loss_ema = None
    rng_at_step = RngStates.take(rng)
    try:
        while step < args.steps:
            elapsed = time.time() - t_start
            if args.time_budget and elapsed >= args.time_budget:
                break
            lr = lr_at(step, elapsed, args)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = torch.from_numpy(sample_windows(data.train, rng, args.batch_size, args.seq_len + 1)).to(device)
            loss = lm_loss(model, batch, device)
            loss_v, gnorm = backward_checked(model, opt, loss, step + 1, lr, args.grad_clip, checkpoint_path(out))
            with ctrl_c_deferred():  # the update, its step count and the RNG states to resume go together
                opt.step()
                imbalance = balancer.step()
                step += 1
                rng_at_step = RngStates.take(rng)
            loss_ema = loss_v if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_v
            bar.update(1)
            tok_s = step * tokens_per_step / max(1e-9, time.time() - t_start)
            bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
            if step % args.eval_every == 0:
                ev = heldout_loss(model, eval_windows, device)
                rec = {"step": step, "seconds": round(time.time() - t_start, 1), "train_loss": round(loss_ema, 4),
                       "heldout_loss": round(ev, 4), "grad_norm": round(gnorm, 3),
                       "expert_imbalance": round(imbalance, 2), "tokens_per_s": round(tok_s)}
                history.append(rec)
                log(f"eval {rec}")
            if step % args.save_every == 0:
                save_checkpoint(out, model, opt, step, time.time() - t_start, rng, history, args)
    except KeyboardInterrupt:
        rng_at_step.restore(rng)
        save_checkpoint(out, model, opt, step, time.time() - t_start, rng, history, args)
        raise TrainingInterrupted(step, checkpoint_path(out)) from None
    finally:
        bar.close()
    elapsed = time.time() - t_start
    save_checkpoint(out, model, opt, step, elapsed, rng, history, args)
    ev = heldout_loss(model, eval_windows, device)
    export_hf(model, out, data.dir)
    metrics = {
        "steps": step, "seconds": round(elapsed, 1), "tokens_seen": step * tokens_per_step,
        "parameters": n_params, "heldout_loss": round(ev, 4), "heldout_ppl": round(math.exp(ev), 3),
        "train_loss_ema": None if loss_ema is None else round(loss_ema, 4), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "args": asdict(args), "history": history,
    }
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"target done: {step} steps, {elapsed:.0f}s, held-out loss {ev:.4f} (ppl {math.exp(ev):.2f})")
    return metrics


def _resume(out: Path, model, opt, rng, args, log):
    path = checkpoint_path(out)
    state = read_checkpoint(path)
    saved = state["args"]
    if "anchors" in saved:
        raise ValueError(f"--resume: {path} is a drafter checkpoint, not a target's: choose another --out")
    for key in ("preset", "seq_len", "batch_size"):
        if saved.get(key) != getattr(args, key):
            raise ValueError(f"--resume: checkpoint has {key}={saved.get(key)!r}, arguments say {getattr(args, key)!r}")
    restore_checkpoint(path, state, model, opt, rng)
    log(f"resumed {path} at step {state['step']} ({state['elapsed']:.0f}s)")
    return state["step"], state["elapsed"], state["history"]


def check_data_matches_target(data: TokenData, target_dir: str | Path, vocab_size: int) -> None:
    """--data must hold token ids of the target's own tokenizer: the same vocabulary as the
    target folder's tokenizer.json (when it has one) and no id past the target's embedding."""
    theirs = Path(target_dir) / "tokenizer.json"
    if theirs.is_file() and load_tokenizer(theirs).get_vocab() != load_tokenizer(data.tokenizer_path).get_vocab():
        raise ValueError(f"--data {data.dir} was tokenized with another tokenizer than --target {target_dir} "
                         f"(their tokenizer.json vocabularies differ): re-run `treeflash train tokenizer "
                         f"--tokenizer {target_dir}` to encode the corpus with the target's tokenizer")
    top = max((int(s.max()) for s in (data.train, data.heldout) if len(s)), default=-1)
    if top >= vocab_size:
        raise ValueError(f"--data {data.dir} has token id {top}, past --target {target_dir}'s vocabulary of "
                         f"{vocab_size}: the corpus was tokenized for another model")


def load_target(path: str | Path, device: torch.device | str = "cpu", dtype=torch.float32):
    """An exported target (HF format) ready for inference."""
    from transformers import DeepseekV3ForCausalLM

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"target {path}: no config.json (run `treeflash train target --out {path}` first)")
    try:
        model_type = json.loads((p / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"target {path}: cannot read config.json ({e})") from None
    if model_type != "deepseek_v3":  # e.g. a drafter folder passed as --target
        raise ValueError(f"target {path}: config.json has model_type {model_type!r}, expected a DeepSeek-V3 "
                         "target ('deepseek_v3', as `treeflash train target` writes)")
    from safetensors import SafetensorError

    try:
        model = DeepseekV3ForCausalLM.from_pretrained(p, dtype=dtype, attn_implementation="sdpa")
    except (OSError, RuntimeError, SafetensorError) as e:  # missing, truncated or mis-shaped weights
        raise ValueError(f"target {path}: cannot load the model ({str(e).strip().splitlines()[0]})") from None
    return model.to(device).eval()

