"""Corpus collection: de-duplication, stable path-hash split, token windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from treeflash.train.corpus import (
    fixed_windows,
    load_corpus,
    pack,
    sample_windows,
    split_of,
)


def _write(root: Path, rel: str, text: str | bytes) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_split_is_stable_and_proportional():
    paths = [f"pkg{i}/mod{i % 7}.py" for i in range(20_000)]
    held = [p for p in paths if split_of(p, 5.0) == "heldout"]
    assert 0.04 < len(held) / len(paths) < 0.06
    assert held == [p for p in paths if split_of(p, 5.0) == "heldout"]  # deterministic
    assert split_of("json/decoder.py") == split_of("json/decoder.py")


def test_load_corpus_dedups_skips_and_splits(tmp_path):
    _write(tmp_path, "b/x.py", "def f():\n    return 1\n")
    _write(tmp_path, "a/x.py", "def f():\n    return 1\n")  # duplicate content: keeps a/x.py
    _write(tmp_path, "c/__pycache__/y.py", "print(1)\n")  # skipped folder
    _write(tmp_path, "d/bad.py", b"\xff\xfe not utf-8")  # skipped: not UTF-8
    _write(tmp_path, "d/empty.py", "   \n")  # skipped: blank
    _write(tmp_path, "d/crlf.py", "x = 1\r\ny = 2\r\n")
    _write(tmp_path, "d/notes.txt", "not python")
    for i in range(40):
        _write(tmp_path, f"m/mod{i}.py", f"VALUE_{i} = {i}\n")
    c = load_corpus(tmp_path, heldout_percent=20.0)
    paths = sorted(f.relpath for f in c.train + c.heldout)
    assert "a/x.py" in paths and "b/x.py" not in paths
    assert not any("__pycache__" in p or p.endswith(".txt") or "bad" in p or "empty" in p for p in paths)
    assert next(f for f in c.train + c.heldout if f.relpath == "d/crlf.py").text == "x = 1\ny = 2\n"
    assert c.heldout and c.train
    assert all(split_of(f.relpath, 20.0) == "heldout" for f in c.heldout)
    again = load_corpus(tmp_path, heldout_percent=20.0)
    assert [f.relpath for f in again.heldout] == [f.relpath for f in c.heldout]


def test_max_bytes_caps_the_corpus(tmp_path):
    for i in range(50):
        _write(tmp_path, f"m/mod{i}.py", "x = 1  # padding padding padding\n" * 10)  # same text: dedup
        _write(tmp_path, f"n/mod{i}.py", f"y{i} = {i}\n" * 10)
    c = load_corpus(tmp_path, max_bytes=500, heldout_percent=10.0)
    assert sum(len(f.text) for f in c.train + c.heldout) <= 500


@pytest.mark.slow
def test_default_roots_find_the_stdlib():
    c = load_corpus(max_bytes=2_000_000)
    assert len(c.train) > 10
    assert all(not f.relpath.startswith("/") for f in c.train)


def test_bad_corpus_arguments(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="no Python source"):
        load_corpus(tmp_path)
    _write(tmp_path, "a.py", "x = 1\n")
    with pytest.raises(ValueError, match="heldout_percent"):
        load_corpus(tmp_path, heldout_percent=0)


def test_windows():
    stream = pack([[0, 5, 6, 1], [0, 7, 1]])
    assert stream.dtype == np.uint16 and stream.tolist() == [0, 5, 6, 1, 0, 7, 1]
    rng = np.random.default_rng(0)
    w = sample_windows(stream, rng, batch=3, length=4)
    assert w.shape == (3, 4) and w.dtype == np.int64
    f = fixed_windows(stream, count=2, length=3)
    assert len(f) == 2 and f[0].tolist() == [0, 5, 6] and f[-1].tolist() == stream[-3:].tolist()
    with pytest.raises(ValueError, match="fewer than"):
        sample_windows(stream, rng, 1, 10)
