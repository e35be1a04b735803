"""Training corpus that exists on every machine: Python source already on disk.

Files come from the running interpreter's standard library and installed packages, or
from any `--corpus DIR`. They are de-duplicated by content and split train/held-out by a
hash of their path relative to the root they were found under, so the split of, say,
`json/decoder.py` is the same on every machine and every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Folders that hold installed packages; walked as roots of their own, never inside stdlib.
_PACKAGE_DIRS = {"site-packages", "dist-packages"}
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules", ".tox", ".venv"}
TOKEN_DTYPE = np.uint16  # vocabularies here stay below 65536


@dataclass(frozen=True)
class SourceFile:
    """One de-duplicated source file. `relpath` (posix) decides its split."""

    relpath: str
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[SourceFile]
    heldout: list[SourceFile]
    roots: list[str]

    def summary(self) -> dict:
        return {
            "roots": self.roots,
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": sum(len(f.text.encode()) for f in self.train),
            "heldout_bytes": sum(len(f.text.encode()) for f in self.heldout),
        }


def _path_hash(relpath: str) -> int:
    return int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")


def split_of(relpath: str, heldout_percent: float = 2.0) -> str:
    """'heldout' for a stable `heldout_percent` share of paths, else 'train'."""
    bucket = _path_hash(relpath) % 10_000
    return "heldout" if bucket < heldout_percent * 100 else "train"


def default_roots() -> list[Path]:
    """The interpreter's stdlib and its package directories, existing ones only, no repeats."""
    paths = sysconfig.get_paths()
    candidates = [paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")]
    candidates += list(site.getsitepackages()) + [site.getusersitepackages()]
    roots: list[Path] = []
    for c in candidates:
        if c and Path(c).is_dir() and Path(c).resolve() not in roots:
            roots.append(Path(c).resolve())
    return roots


def _walk_py(root: Path, nested_roots: set[Path], skip_package_dirs: bool) -> Iterator[Path]:
    skip = _SKIP_DIRS | _PACKAGE_DIRS if skip_package_dirs else _SKIP_DIRS
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        # Package dirs inside the stdlib are walked as their own roots (stable relpaths).
        dirnames[:] = sorted(d for d in dirnames if d not in skip and (here / d).resolve() not in nested_roots)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def iter_source_files(
    roots: Iterable[Path], max_file_bytes: int, skip_package_dirs: bool = True
) -> Iterator[tuple[str, Path]]:
    """(relpath, path) of each .py file under `roots`, at most `max_file_bytes` big.

    With `skip_package_dirs`, site-packages/dist-packages folders met inside a root are
    skipped (the interpreter's package dirs are roots of their own).
    """
    roots = [Path(r).resolve() for r in roots]
    nested = set(roots)
    for root in roots:
        for path in _walk_py(root, nested - {root}, skip_package_dirs):
            try:
                if path.is_symlink() or path.stat().st_size > max_file_bytes:
                    continue
            except OSError:
                continue
            yield path.relative_to(root).as_posix(), path


def _read_text(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n")
    return text if text.strip() and "\x00" not in text else None


def load_corpus(
    corpus_dir: str | Path | None = None,
    *,
    heldout_percent: float = 2.0,
    max_bytes: int | None = None,
    max_file_bytes: int = 256_000,
) -> Corpus:
    """Collect, de-duplicate and split the corpus.

    With `max_bytes`, files are taken in the order of their path hash (a stable, mixed
    sample of all packages) until the budget is spent. Duplicated contents keep the
    smallest relpath, so the choice does not depend on the walk order.
    """
    if corpus_dir is not None:
        root = Path(corpus_dir)
        if not root.is_dir():
            raise ValueError(f"--corpus {corpus_dir}: not a directory")
        roots = [root.resolve()]
    else:
        roots = default_roots()
    if not 0.0 < heldout_percent < 100.0:
        raise ValueError(f"heldout_percent must be in (0, 100), got {heldout_percent}")
    found = iter_source_files(roots, max_file_bytes, skip_package_dirs=corpus_dir is None)
    candidates = sorted(found, key=lambda rp: (_path_hash(rp[0]), rp[0]))
    by_content: dict[bytes, SourceFile] = {}
    total = 0
    for relpath, path in candidates:
        text = _read_text(path)
        if text is None:
            continue
        key = hashlib.sha1(text.encode()).digest()
        old = by_content.get(key)
        if old is not None:
            if relpath < old.relpath:
                by_content[key] = SourceFile(relpath, text)
            continue
        if max_bytes is not None and total + len(text) > max_bytes:
            continue
        by_content[key] = SourceFile(relpath, text)
        total += len(text)
    # Same relpath under two roots (rare): keep one, by content hash, for a stable result.
    by_path: dict[str, SourceFile] = {}
    for f in sorted(by_content.values(), key=lambda f: (f.relpath, hashlib.sha1(f.text.encode()).digest())):
        by_path.setdefault(f.relpath, f)
    files = sorted(by_path.values(), key=lambda f: f.relpath)
    if not files:
        raise ValueError(f"no Python source files found under {', '.join(map(str, roots))}")
    train = [f for f in files if split_of(f.relpath, heldout_percent) == "train"]
    heldout = [f for f in files if split_of(f.relpath, heldout_percent) == "heldout"]
    return Corpus(train=train, heldout=heldout, roots=[str(r) for r in roots])


# ---- tokenized streams ---------------------------------------------------------------


def pack(docs: Iterable[Iterable[int]]) -> np.ndarray:
    """Concatenate already-delimited token lists (BOS doc EOS) into one flat stream."""
    arrays = [np.asarray(d, dtype=TOKEN_DTYPE) for d in docs]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=TOKEN_DTYPE)


def save_stream(path: Path, tokens: np.ndarray) -> None:
    np.asarray(tokens, dtype=TOKEN_DTYPE).tofile(path)


def load_stream(path: Path) -> np.ndarray:
    if not Path(path).is_file():
        raise ValueError(f"token stream {path} not found (run `treeflash train tokenizer` first)")
    return np.fromfile(path, dtype=TOKEN_DTYPE)


@dataclass
class TokenData:
    """The tokenized corpus written by `treeflash train tokenizer`."""

    dir: Path
    train: np.ndarray
    heldout: np.ndarray
    manifest: dict

    @staticmethod
    def load(data_dir: str | Path) -> TokenData:
        d = Path(data_dir)
        man = d / "data" / "manifest.json"
        if not man.is_file():
            raise ValueError(
                f"--data {data_dir}: no data/manifest.json (run `treeflash train tokenizer --out {data_dir}`)"
            )
        manifest = json.loads(man.read_text())
        return TokenData(d, load_stream(d / "data" / "train.bin"), load_stream(d / "data" / "heldout.bin"), manifest)

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / "tokenizer.json"


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` random windows of `length` tokens from `stream`, as int64 [batch, length]."""
    if len(stream) < length + 1:
        raise ValueError(f"token stream has {len(stream)} tokens, fewer than one window of {length + 1}")
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def fixed_windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    """`count` evenly spaced windows (deterministic held-out evaluation batches)."""
    if len(stream) < length:
        raise ValueError(f"held-out stream has {len(stream)} tokens, fewer than {length}")
    n = min(count, max(1, len(stream) // length))
    starts = np.linspace(0, len(stream) - length, num=n).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)
