"""`treeflash bench export`: write a preset's random-weight pair as real checkpoints.

Presets are built in memory on one GPU; a tensor-parallel run loads each rank's shards
from a checkpoint instead (`--model`, `--tp N`). This writes the preset's target in the
Hugging Face DeepSeek-V3 layout (routed experts unstacked to `mlp.experts.{e}.*_proj`; INT4 ones
as compressed-tensors stores them: `weight_packed`, `weight_scale`, `weight_shape`; sharded
safetensors with an index) and its drafter in the z-lab DFlash layout, both with
the preset's `config.json`. The weights are the preset's own (same seed, the planted greedy
chain included), so `--acceptance oracle` runs are exact in bf16 on any number of ranks.

    treeflash bench export --preset kimi-k2 --out /tmp/k2      # -> /tmp/k2/target, /tmp/k2/drafter
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts_(gate|up|down)(_packed|_scale)?$")


def cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor as its own contiguous CPU copy for safetensors' save_file: a drafter's
    re-homed projections are slices of one stack (models/drafter.py `_rehome`), and
    safetensors versions differ on tensors that share storage; own copies save the same way
    everywhere."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def hf_tensors(state_dict: dict[str, torch.Tensor]):
    """(name, tensor) in the Hugging Face layout: stacked experts become one tensor each (an INT4
    stack its packed words, scales and logical [out, in] shape: `kernels/int4.py`)."""
    from treeflash.kernels.int4 import PACK

    for name, t in state_dict.items():
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        base, field = m.group(1), {None: "weight", "_packed": "weight_packed", "_scale": "weight_scale"}[m.group(3)]
        for e in range(t.shape[0]):
            proj = f"{base}.experts.{e}.{m.group(2)}_proj"
            yield f"{proj}.{field}", t[e]
            if field == "weight_packed":
                yield f"{proj}.weight_shape", torch.tensor([t.shape[1], t.shape[2] * PACK], dtype=torch.int32)


def save_sharded(tensors, out: Path, shard_bytes: int, progress: bool = True) -> list[Path]:
    """safetensors shards of at most ~shard_bytes each, plus model.safetensors.index.json."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, files = {}, []
    for fname, shard in tqdm(list(zip(names, shards)), desc=f"writing {out.name}", unit="shard",
                             disable=not progress):
        save_file(cpu_copies(shard), out / fname,
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        files.append(out / fname)
    total = sum(f.stat().st_size for f in files)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return files


def export_preset(name: str, out: str | Path, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  shard_bytes: int = 4 << 30, progress: bool = True) -> tuple[Path, Path]:
    """Write preset `name` as out/target (HF) and out/drafter (z-lab); returns both paths."""
    from safetensors.torch import save_file

    from treeflash.bench.presets import build_preset

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give an empty or new folder")
    model, drafter, preset = build_preset(name, device, dtype, seed)
    target_dir, drafter_dir = out / "target", out / "drafter"
    save_sharded(hf_tensors(model.state_dict()), target_dir, shard_bytes, progress)
    (target_dir / "config.json").write_text(json.dumps(preset.target, indent=1))
    drafter_dir.mkdir(parents=True)
    save_file(cpu_copies(drafter.state_dict()),
              drafter_dir / "model.safetensors", metadata={"format": "pt"})
    (drafter_dir / "config.json").write_text(json.dumps(preset.drafter, indent=1))
    (out / "README.md").write_text(
        f"Random-weight export of treeflash preset `{name}` (seed {seed}, {str(dtype).removeprefix('torch.')}),"
        f" written by `treeflash bench export`.\n\n{preset.notes}\n\nNot a trained model: acceptance must be"
        " declared (`--acceptance oracle` or a fixed length).\n")
    return target_dir, drafter_dir
