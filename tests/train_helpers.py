"""A tiny corpus and tokenizer for the training smoke tests (stdlib packages, CPU, seconds)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

from treeflash.train.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def tiny_tokenized(root: Path) -> Path:
    """Copy three stdlib packages under root/corpus, train a 400-token BPE on them into root/tok."""
    corpus = root / "corpus"
    for pkg in ("json", "logging", "concurrent"):
        shutil.copytree(STDLIB / pkg, corpus / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert main(["tokenizer", "--out", str(root / "tok"), "--corpus", str(corpus), "--vocab-size", "400",
                 "--heldout-percent", "20"]) == 0
    return root / "tok"
