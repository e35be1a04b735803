"""Train a DFlash drafter (z-lab format) for a trained target, with the DFlash recipe.

Each training sequence is run through the frozen target once, which gives the tapped
hidden states (HF `hidden_states[L+1]` for each L in `target_layer_ids`) and the target's
own greedy prediction at every position. Many random anchors are drawn per sequence; each
gets a block `[token[a], MASK x (B-1)]` at positions a..a+B-1 that sees the target features
strictly before a (and, in sliding layers, only the last W-1 of them plus earlier block
slots). Slot k is trained to predict the target's greedy token for position a+k (teacher
forced: argmax of the target's logits at a+k-1), weighted by exp(-(k-1)/gamma). All blocks
of a batch go through the drafter in one forward pass with per-layer-type masks.

The model is `dflash.model.DFlashDraftModel` itself, so the saved folder is what the
z-lab reference (and treeflash) load.
"""

from __future__ import annotations

import json
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
    ctrl_c_deferred,
    lr_at,
    prepare_out_dir,
    read_checkpoint,
    resolve_device,
    restore_checkpoint,
    save_checkpoint,
    seed_everything,
    staged_files,
)
from .target import check_data_matches_target, load_target
from .tokenizer import load_tokenizer, special_ids


@dataclass(frozen=True)
class DrafterShape:
    layer_types: tuple[str, ...]
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    gamma: float  # loss decay exp(-(k-1)/gamma); the paper uses 7 for B=16, 4 for B=8
    num_taps: int = 3
    target_layer_ids: tuple[int, ...] | None = None  # None: spread over layers 1..N-2


DRAFTER_PRESETS: dict[str, DrafterShape] = {
    # The shipped drafter: one sliding-window layer, one full layer (~1.4M parameters).
    "small": DrafterShape(
        layer_types=("sliding_attention", "full_attention"), sliding_window=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
        block_size=16, gamma=7.0,
    ),
    "tiny": DrafterShape(
        layer_types=("sliding_attention", "full_attention"), sliding_window=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        block_size=4, gamma=4.0, target_layer_ids=(0, 1),
    ),
}


def default_taps(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread over layers 1..N-2.

    The last layer is left out on purpose: transformers returns it after the final norm in
    `hidden_states[-1]`, so "the output of layer N-1" would mean different things to
    different readers.
    """
    hi = max(1, num_target_layers - 2)
    if num_taps == 1:
        return [min(hi, num_target_layers // 2)]
    return sorted({int(1 + i * (hi - 1) / (num_taps - 1) + 0.5) for i in range(num_taps)})


def drafter_config(shape: DrafterShape, target_cfg, mask_token_id: int):
    """A Qwen3Config in the z-lab DFlash layout for `target_cfg`."""
    from transformers import Qwen3Config

    n = target_cfg.num_hidden_layers
    taps = list(shape.target_layer_ids) if shape.target_layer_ids else default_taps(n, shape.num_taps)
    if any(t < 0 or t >= n for t in taps):
        raise ValueError(f"target_layer_ids {taps} outside the target's {n} layers")
    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=len(shape.layer_types),
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rope_parameters=dict(target_cfg.rope_parameters),  # same YaRN as the target
        use_sliding_window=True,
        sliding_window=shape.sliding_window,
        max_window_layers=0,
        layer_types=list(shape.layer_types),
        tie_word_embeddings=False,
        bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id,
        pad_token_id=target_cfg.pad_token_id,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = n
    cfg.dflash_config = {"target_layer_ids": taps, "block_size": shape.block_size, "mask_token_id": mask_token_id}
    cfg.auto_map = {"AutoModel": "dflash.model.DFlashDraftModel"}
    return cfg


# ---- one-pass multi-block forward ----------------------------------------------------


def block_masks(anchors: torch.Tensor, ctx_len: int, block: int, window: int) -> dict[str, torch.Tensor]:
    """Boolean visibility masks [b, 1, N*B, ctx_len + N*B] for anchors [b, N].

    Query (n, k) sits at position a_n + k. full_attention: context j < a_n and the whole
    own block. sliding_attention: additionally (a_n + k) - j < W for context, and only
    slots k' <= k of its own block (the reference's default in-block causality).
    """
    b, n = anchors.shape
    dev = anchors.device
    k = torch.arange(block, device=dev)
    a = anchors[:, :, None].expand(b, n, block).reshape(b, n * block, 1)  # [b, NB, 1]
    qpos = a + k.repeat(n)[None, :, None]
    j = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_full = j < a  # [b, NB, S]
    ctx_slide = ctx_full & (qpos - j < window)
    qblk = torch.arange(n * block, device=dev) // block
    same = qblk[:, None] == qblk[None, :]
    causal = same & (torch.arange(n * block, device=dev)[None, :] <= torch.arange(n * block, device=dev)[:, None])
    full = torch.cat([ctx_full, same[None].expand(b, -1, -1)], dim=-1)
    slide = torch.cat([ctx_slide, causal[None].expand(b, -1, -1)], dim=-1)
    return {"full_attention": full[:, None], "sliding_attention": slide[:, None]}


def multi_block_forward(model, target_hidden, noise_embedding, position_ids, masks) -> torch.Tensor:
    """`DFlashDraftModel.forward` with one mask per layer type (the reference takes one mask)."""
    hidden = noise_embedding
    ctx = model.hidden_norm(model.fc(target_hidden))
    pos_emb = model.rotary_emb(hidden, position_ids)
    for i, layer in enumerate(model.layers):
        hidden = layer(
            hidden_states=hidden, target_hidden=ctx, attention_mask=masks[model.config.layer_types[i]],
            position_ids=position_ids, past_key_value=None, use_cache=False, position_embeddings=pos_emb,
        )
    return model.norm(hidden)


def draft_logits(model, target, taps, tokens, anchors) -> torch.Tensor:
    """Drafter logits [b, N, B-1, V] for the blocks at `anchors` [b, N] of `tokens` [b, S].

    `taps` [b, S, n_taps*H] are the target features of `tokens`; slot 0 of each block is
    the real token at the anchor, slots 1.. are MASK.
    """
    b, s = tokens.shape
    n = anchors.shape[1]
    bs = model.block_size
    mask_id = model.mask_token_id
    block_tokens = torch.full((b, n, bs), mask_id, dtype=torch.long, device=tokens.device)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    embed = target.get_input_embeddings().weight
    scale = float(model.config.dflash_config.get("input_embedding_scale", 1.0))
    noise = F.embedding(block_tokens.view(b, n * bs), embed) * scale
    block_pos = (anchors[:, :, None] + torch.arange(bs, device=tokens.device)).view(b, n * bs)
    ctx_pos = torch.arange(s, device=tokens.device)[None].expand(b, -1)
    position_ids = torch.cat([ctx_pos, block_pos], dim=1)
    masks = block_masks(anchors, s, bs, model.config.sliding_window)
    dtype = next(model.parameters()).dtype  # residual stream in the drafter's own dtype
    hidden = multi_block_forward(model, taps.to(dtype), noise.to(dtype), position_ids, masks)
    hidden = hidden.view(b, n, bs, -1)[:, :, 1:]
    return model.compute_logits(hidden, target.lm_head)


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, tap_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tapped features [b, S, n*H] and the target's greedy next-token predictions [b, S]."""
    out = target(input_ids=tokens, output_hidden_states=True, use_cache=False)
    taps = torch.cat([out.hidden_states[i + 1] for i in tap_ids], dim=-1)
    return taps, out.logits.argmax(-1)


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, block: int, count: int) -> np.ndarray:
    """Sorted distinct anchors in [1, seq_len - block] (context non-empty, block inside)."""
    hi = seq_len - block + 1
    if hi <= 1:
        raise ValueError(f"seq_len {seq_len} too short for block_size {block}")
    count = min(count, hi - 1)
    return np.stack([np.sort(rng.choice(np.arange(1, hi), size=count, replace=False)) for _ in range(batch)])


def block_loss(logits, preds, anchors, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted CE against the target's greedy tokens; also per-slot accuracy [B-1]."""
    b, n, km1, v = logits.shape
    k = torch.arange(1, km1 + 1, device=logits.device)
    # the target's greedy token for position a+k is its prediction at a+k-1
    labels = preds.gather(1, (anchors[:, :, None] + k - 1).view(b, -1)).view(b, n, km1)
    w = torch.exp(-(k.float() - 1) / gamma)
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(b, n, km1)
    loss = (ce * w).sum() / (w.sum() * b * n)
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, acc


# ---- training ----------------------------------------------------------------------


@dataclass
class DrafterTrainArgs:
    data: str
    target: str
    out: str
    preset: str = "small"
    seq_len: int = 8192
    batch_size: int = 4
    anchors: int = 512
    steps: int = 100_000
    time_budget: float | None = None
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    save_every: int = 200
    seed: int = 0
    device: str = "auto"
    resume: bool = False
    progress: bool = True
    init: str | None = None  # start from this drafter folder's weights (fresh optimizer and schedule)

    def validate(self) -> None:
        if self.preset not in DRAFTER_PRESETS:
            raise ValueError(f"--preset must be one of {sorted(DRAFTER_PRESETS)}, got {self.preset!r}")
        for name in ("seq_len", "batch_size", "anchors", "steps", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.seq_len <= DRAFTER_PRESETS[self.preset].block_size:
            raise ValueError(f"--seq-len must exceed the block size {DRAFTER_PRESETS[self.preset].block_size}")
        if self.time_budget is not None and not self.time_budget > 0:  # nan too: it would never stop the run
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        check_lr(self.lr, self.min_lr_ratio)
        if not 0 <= self.seed < 2**64:  # numpy's and torch's seed range
            raise ValueError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.init is not None and not (Path(self.init) / "config.json").is_file():
            raise ValueError(f"--init {self.init}: no config.json (expected a drafter folder, e.g. "
                             "src/treeflash/assets/drafter or the --out of an earlier `treeflash train drafter`)")


def build_drafter(shape: DrafterShape, target, mask_id: int):
    from dflash.model import DFlashDraftModel

    cfg = drafter_config(shape, target.config, mask_id)
    cfg._attn_implementation = "sdpa"
    return DFlashDraftModel(cfg)


# Config entries that decide the drafter's weights and what they mean; --init needs them equal.
_INIT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "use_sliding_window",
              "num_target_layers", "max_position_embeddings", "rope_parameters")
_INIT_DFLASH_KEYS = ("target_layer_ids", "block_size", "mask_token_id")


def init_config_mismatches(saved: dict, cfg) -> list[str]:
    """'key: saved vs expected' for each architecture entry where a saved drafter config.json
    differs from `cfg` (the config the preset builds for this target)."""
    want = cfg.to_dict()
    out = [f"{k}: {saved.get(k)!r} vs {want.get(k)!r}" for k in _INIT_KEYS if saved.get(k) != want.get(k)]
    sd, wd = saved.get("dflash_config") or {}, want.get("dflash_config") or {}
    out += [f"dflash_config.{k}: {sd.get(k)!r} vs {wd.get(k)!r}" for k in _INIT_DFLASH_KEYS if sd.get(k) != wd.get(k)]
    return out


def load_init_weights(model, init_dir: str | Path, preset: str = "?") -> None:
    """Copy the weights of the drafter folder `init_dir` into `model` (cast to its dtype).

    The folder's config must describe the same architecture as `model.config` (the preset's
    shape on this target, same taps, block size and mask id); anything else is a ValueError
    that names the entries that differ.
    """
    from safetensors.torch import load_file

    d = Path(init_dir)
    try:
        saved = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--init {init_dir}: cannot read config.json ({e})") from None
    bad = init_config_mismatches(saved, model.config)
    if bad:
        raise ValueError(
            f"--init {init_dir}: the drafter there does not match --preset {preset} on this target "
            f"(saved vs expected): {'; '.join(bad)}. Pass the --preset it was trained with and the same --target."
        )
    weights = d / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"--init {init_dir}: no model.safetensors")
    state = load_file(str(weights))
    try:
        model.load_state_dict(state, strict=True)  # copies into the existing (fp32) parameters
    except RuntimeError as e:
        raise ValueError(f"--init {init_dir}: weights do not fit the model: {str(e).splitlines()[0]}") from None


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32):
    from dflash.model import DFlashDraftModel

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"drafter {path}: no config.json (run `treeflash train drafter --out {path}` first)")
    return DFlashDraftModel.from_pretrained(p, dtype=dtype).to(device).eval()


@torch.no_grad()
def drafter_eval(model, target, windows: np.ndarray, tap_ids, args, device) -> dict:
    """Held-out decayed loss and per-slot accuracy (anchors fixed by seed 1234)."""
    model.eval()
    rng = np.random.default_rng(1234)
    losses, accs = [], []
    for w in windows:
        tokens = torch.from_numpy(w[None]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            taps, preds = target_features(target, tokens, tap_ids)
            anchors = sample_anchors(rng, 1, tokens.shape[1], model.block_size, args.anchors)
            anchors = torch.from_numpy(anchors).to(device)
            logits = draft_logits(model, target, taps, tokens, anchors)
        loss, acc = block_loss(logits, preds, anchors, DRAFTER_PRESETS[args.preset].gamma)
        losses.append(float(loss))
        accs.append(acc)
    model.train()
    acc = torch.stack(accs).mean(0)
    # expected chain length if slot errors were independent given the prefix is right
    chain = 1 + float(torch.cumprod(acc, 0).sum())
    return {"loss": round(float(np.mean(losses)), 4), "slot_acc": [round(float(x), 3) for x in acc],
            "est_chain_acceptance": round(chain, 3)}


def _target_and_drafter(args: DrafterTrainArgs, shape: DrafterShape, data: TokenData, ids, device):
    """The frozen target (bf16 on CUDA) checked against --data and --seq-len, and the drafter
    built for it on `device` (from --init's weights if given)."""
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(args.target, device, target_dtype)
    check_data_matches_target(data, args.target, target.config.vocab_size)
    check_seq_len(args.seq_len, target.config.max_position_embeddings, f"--target {args.target}'s")
    for p in target.parameters():
        p.requires_grad_(False)
    model = build_drafter(shape, target, ids.mask)
    if args.init is not None:  # checked even with --resume (the checkpoint's weights win then)
        load_init_weights(model, args.init, args.preset)
    return target, model.to(device)


def _batch_loss(model, target, data: TokenData, rng, args: DrafterTrainArgs, shape: DrafterShape, device):
    """One sampled batch of windows and anchor blocks through the target and the drafter:
    (the block loss, per-slot accuracy)."""
    tokens = torch.from_numpy(sample_windows(data.train, rng, args.batch_size, args.seq_len)).to(device)
    anchors = sample_anchors(rng, args.batch_size, args.seq_len, shape.block_size, args.anchors)
    anchors = torch.from_numpy(anchors).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        taps, preds = target_features(target, tokens, model.target_layer_ids)
        logits = draft_logits(model, target, taps, tokens, anchors)
    return block_loss(logits, preds, anchors, shape.gamma)


def train_drafter(args: DrafterTrainArgs, log=print) -> dict:
    from tqdm.auto import tqdm

    from .loop import make_optimizer

    args.validate()
    device = resolve_device(args.device)
    data = TokenData.load(args.data)
    ids = special_ids(load_tokenizer(data.tokenizer_path))
    out = prepare_out_dir(args.out)
    shape = DRAFTER_PRESETS[args.preset]
    seed_everything(args.seed)
    target, model = _target_and_drafter(args, shape, data, ids, device)
    tap_ids = model.target_layer_ids
    opt = make_optimizer(model, args.lr, args.weight_decay)
    rng = np.random.default_rng(args.seed)
    ckpt = out / "checkpoint.pt"
    step, elapsed, history = 0, 0.0, []
    if args.resume:
        step, elapsed, history = _resume(ckpt, model, opt, rng, args, log)
    elif ckpt.exists():
        raise ValueError(f"{ckpt} exists: pass --resume to continue it, or choose another --out")
    eval_windows = fixed_windows(data.heldout, args.eval_batches, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M parameters, taps {tap_ids}, block {shape.block_size}, device {device}")
    init_ev = None
    if args.init is not None and not args.resume:
        init_ev = drafter_eval(model, target, eval_windows, tap_ids, args, device)
        log(f"init from {args.init} (fresh optimizer, lr schedule from step 0): held-out {init_ev}")
    model.train()
    t_start = time.time() - elapsed
    bar = tqdm(total=args.steps, initial=step, disable=not args.progress, desc="drafter", dynamic_ncols=True)
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
            loss, acc = _batch_loss(model, target, data, rng, args, shape, device)
            loss_v, _ = backward_checked(model, opt, loss, step + 1, lr, args.grad_clip, ckpt)
            with ctrl_c_deferred():  # the update, its step count and the RNG states to resume go together
                opt.step()
                step += 1
                rng_at_step = RngStates.take(rng)
            loss_ema = loss_v if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_v
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", acc1=f"{float(acc[0]):.2f}", lr=f"{lr:.2e}")
            if step % args.eval_every == 0:
                ev = drafter_eval(model, target, eval_windows, tap_ids, args, device)
                rec = {"step": step, "seconds": round(time.time() - t_start, 1), "train_loss": round(loss_ema, 4), **ev}
                history.append(rec)
                log(f"eval {rec}")
            if step % args.save_every == 0:
                save_checkpoint(out, model, opt, step, time.time() - t_start, rng, history, args)
    except KeyboardInterrupt:
        rng_at_step.restore(rng)
        save_checkpoint(out, model, opt, step, time.time() - t_start, rng, history, args)
        raise TrainingInterrupted(step, ckpt) from None
    finally:
        bar.close()
    elapsed = time.time() - t_start
    save_checkpoint(out, model, opt, step, elapsed, rng, history, args)
    ev = drafter_eval(model, target, eval_windows, tap_ids, args, device)
    export_drafter(model, out)
    metrics = {"steps": step, "seconds": round(elapsed, 1), "parameters": n_params, "heldout": ev,
               "init": args.init, "init_heldout": init_ev, "target_layer_ids": list(tap_ids),
               "block_size": shape.block_size, "args": asdict(args), "history": history}
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"drafter done: {step} steps, {elapsed:.0f}s, held-out {ev}")
    return metrics


def export_drafter(model, out: Path, dtype=torch.bfloat16) -> None:
    import copy

    export = copy.deepcopy(model).to("cpu").to(dtype)
    export.config.dtype = str(dtype).removeprefix("torch.")
    with staged_files(out) as tmp:
        export.save_pretrained(tmp)


def _resume(path: Path, model, opt, rng, args, log):
    state = read_checkpoint(path)
    if "anchors" not in state["args"]:
        raise ValueError(f"--resume: {path} is not a drafter checkpoint (a target's?): choose another --out")
    for key in ("preset", "seq_len", "batch_size", "anchors"):
        if state["args"].get(key) != getattr(args, key):
            raise ValueError(
                f"--resume: checkpoint has {key}={state['args'].get(key)!r}, arguments say {getattr(args, key)!r}"
            )
    restore_checkpoint(path, state, model, opt, rng)
    log(f"resumed {path} at step {state['step']}")
    return state["step"], state["elapsed"], state["history"]
