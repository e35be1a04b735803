"""A tiny corpus and tokenizer for the training smoke tests (stdlib packages, CPU, seconds)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

from treeflash.train.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# the tiny presets' flags for `train target` / `train drafter`
TINY_T = ["--preset", "tiny", "--seq-len", "96", "--batch-size", "2", "--no-progress", "--device", "cpu"]
TINY_D = ["--preset", "tiny", "--seq-len", "96", "--batch-size", "2", "--anchors", "8", "--no-progress",
          "--device", "cpu"]


def tiny_tokenized(root: Path) -> Path:
    """Copy three stdlib packages under root/corpus, train a 400-token BPE on them into root/tok."""
    corpus = root / "corpus"
    for pkg in ("json", "logging", "concurrent"):
        shutil.copytree(STDLIB / pkg, corpus / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert main(["tokenizer", "--out", str(root / "tok"), "--corpus", str(corpus), "--vocab-size", "400",
                 "--heldout-percent", "20"]) == 0
    return root / "tok"


def tiny_target(root: Path, steps: int) -> Path:
    """`tiny_tokenized` under root, then a tiny target trained `steps` steps into root/target."""
    tiny_tokenized(root)
    assert main(["target", "--data", str(root / "tok"), "--out", str(root / "target"), *TINY_T,
                 "--steps", str(steps), "--eval-batches", "1"]) == 0
    return root / "target"
