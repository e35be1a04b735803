"""What training the target and the drafter share: argument checks, the learning-rate schedule,
AdamW, a backward that refuses a non-finite step, Ctrl-C held until a step is whole, and
checkpoints written and read atomically (never unpickling code)."""

from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ADAM_BETAS = (0.9, 0.95)



# AdamW's first step is lr / (1 - beta1) long; past float32's largest value torch raises an
# overflow RuntimeError inside opt.step()
MAX_LR = torch.finfo(torch.float32).max * (1 - ADAM_BETAS[0])



def check_lr(lr: float, min_lr_ratio: float) -> None:
    if not 0 < lr < math.inf or not 0 <= min_lr_ratio <= 1:  # inf: nan weights at the first step
        raise ValueError(f"--lr must be finite and > 0, and --min-lr-ratio in [0, 1] (got {lr}, {min_lr_ratio})")
    if lr >= MAX_LR:
        raise ValueError(f"--lr {lr:g} is too large: AdamW's first step, lr / (1 - beta1), overflows float32 "
                         f"(--lr must be below {MAX_LR:.3g})")



def check_seq_len(seq_len: int, max_positions: int, whose: str) -> None:
    """--seq-len positions must exist in the model: past max_position_embeddings RoPE/YaRN would
    run on positions it was never built for, without any error, and the numbers mean nothing."""
    if seq_len > max_positions:
        raise ValueError(f"--seq-len {seq_len} is more than {whose} max_position_embeddings {max_positions}: "
                         f"pass --seq-len {max_positions} or less")



def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)



def prepare_out_dir(out: str | Path) -> Path:
    """Create the --out folder and check that files can be written there now, not at the
    first checkpoint after hours of training."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {out}: is a file, expected a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return p



def lr_at(step: int, elapsed: float, args) -> float:
    """Linear warmup, then cosine to min_lr_ratio over steps or time budget, whichever ends first."""
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    progress = step / args.steps
    if args.time_budget:
        progress = max(progress, elapsed / args.time_budget)
    progress = min(1.0, progress)
    cos = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)



def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)



def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; no decay on norms, embeddings and the router (1-D or embedding weights)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name or ".gate." in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, eps=1e-8)



class TrainingDiverged(RuntimeError):
    """The loss, gradient norm or weights went inf/NaN; nothing non-finite was saved."""



class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, raised once the step reached is saved; says where, and how to go on."""

    def __init__(self, step: int, ckpt: Path):
        super().__init__(f"interrupted at step {step}: saved {ckpt}; to continue, run the same command with --resume")



@dataclass(frozen=True)
class RngStates:
    """The data order's and torch's RNG states when a step completed. The checkpoint written
    after a Ctrl-C mid-step stores these, so --resume draws the interrupted step's batch again."""

    numpy_state: dict
    torch_state: torch.Tensor

    @classmethod
    def take(cls, rng: np.random.Generator) -> RngStates:
        return cls(rng.bit_generator.state, torch.get_rng_state())

    def restore(self, rng: np.random.Generator) -> None:
        rng.bit_generator.state = self.numpy_state
        torch.set_rng_state(self.torch_state)



@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that comes inside the block until the block ends, so an optimizer
    update and the step count that goes with it happen together or not at all (a checkpoint of
    step n never holds the weights of step n+1). Only the main thread can take SIGINT, and a
    handler not set from Python cannot be put back: there the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        signal.raise_signal(signal.SIGINT)  # to the handler that was there: KeyboardInterrupt by default



def backward_checked(model, opt, loss: torch.Tensor, step: int, lr: float, grad_clip: float,
                     ckpt: Path) -> tuple[float, float]:
    """Backward and clip for 1-based `step`; returns (loss, gradient norm before clipping).

    A non-finite loss or gradient norm raises TrainingDiverged here, before `opt.step()`:
    clipping a NaN norm makes every gradient NaN, and that update would make every weight NaN.
    """
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    loss_v = float(loss.detach())
    if not (math.isfinite(loss_v) and math.isfinite(gnorm)):
        kept = f"{ckpt} is left as it was" if ckpt.exists() else "no checkpoint was written"
        raise TrainingDiverged(f"training diverged at step {step}: loss {loss_v:.4g}, gradient norm {gnorm:.4g} "
                               f"at lr {lr:.3g}; the step was not applied and {kept}: lower --lr, or check --data")
    return loss_v, gnorm



def checkpoint_path(out: Path) -> Path:
    return out / "checkpoint.pt"



def save_checkpoint(out: Path, model, opt, step: int, elapsed: float, rng, history: list, args) -> None:
    """Write out/checkpoint.pt by one atomic rename; non-finite weights raise TrainingDiverged
    instead, so the file there always holds the last good weights."""
    if not bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()):
        raise TrainingDiverged(f"training diverged at step {step}: its update left non-finite weights, so "
                               f"{checkpoint_path(out)} was not written: lower --lr, or check --data")
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "elapsed": elapsed,
        "rng": rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "history": history,
        "args": asdict(args),
    }
    tmp = checkpoint_path(out).with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(checkpoint_path(out))



@contextmanager
def staged_files(out: Path) -> Iterator[Path]:
    """A scratch folder inside `out`; when the block ends without error, each file in it
    replaces out's file of the same name by one atomic rename. So an export cut short
    (Ctrl-C, a full disk) leaves out's previous model files whole, never half-written."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        yield tmp
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)



_CHECKPOINT_KEYS = {"model", "optimizer", "step", "elapsed", "rng", "torch_rng", "history", "args"}



def _brief(e: BaseException, line: int = 0, limit: int = 200) -> str:
    """One line of an exception's message (torch's are many lines long)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[min(line, len(lines) - 1)] if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."



def read_checkpoint(path: Path) -> dict:
    """The dict `save_checkpoint` wrote; a damaged file or another kind of file is a ValueError."""
    if not path.is_file():
        raise ValueError(f"--resume: no checkpoint at {path}")
    try:  # tensors and plain data only: never unpickle code
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"--resume: cannot read {path}, it is damaged or not a training checkpoint "
                         f"({type(e).__name__}{': ' + _brief(e) if str(e).strip() else ''})") from None
    if not isinstance(state, dict) or not _CHECKPOINT_KEYS <= state.keys():
        raise ValueError(f"--resume: {path} is not a treeflash training checkpoint")
    return state



def restore_checkpoint(path: Path, state: dict, model, opt, rng) -> None:
    """Load weights, optimizer and RNG states; weights of another shape are a ValueError."""
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:  # line 0 is "Error(s) in loading state_dict for ..."
        raise ValueError(f"--resume: {path} was trained with another model shape (another --target or --data?): "
                         f"{_brief(e, line=1)}") from None
    rng.bit_generator.state = state["rng"]
    torch.set_rng_state(state["torch_rng"])
