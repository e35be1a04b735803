"""Byte-level BPE tokenizer: specials, BOS on encode, lossless round trip, HF loading."""

from __future__ import annotations

import pytest

from treeflash.train.tokenizer import (
    SPECIAL_TOKENS,
    encode_documents,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)

CODE = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
    "    return quicksort([x for x in xs[1:] if x < pivot]) + [pivot]\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\n\ndef main():\n    print(os.getcwd())  # naïve ünïcode ✓\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CODE, vocab_size=320)


def test_specials_and_bos(tok):
    ids = special_ids(tok)
    assert (ids.bos, ids.eos, ids.pad, ids.mask) == (0, 1, 2, 3)
    assert [tok.id_to_token(i) for i in range(4)] == SPECIAL_TOKENS
    assert tok.encode("x = 1").ids[0] == ids.bos
    assert tok.get_vocab_size() <= 320


def test_round_trip_is_lossless(tok):
    for text in [*CODE[:3], "\t\tweird  spacing\r\n", "emoji 🐍 and 中文"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_documents_end_with_eos(tok):
    docs = encode_documents(tok, ["a = 1\n", "b = 2\n"], batch_size=1)
    assert [d[0] for d in docs] == [0, 0] and [d[-1] for d in docs] == [1, 1]


def test_save_load_and_transformers(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(CODE[0]).ids == tok.encode(CODE[0]).ids
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.mask_token_id == 3 and hf.bos_token_id == 0 and hf.eos_token_id == 1
    assert hf(CODE[0])["input_ids"] == tok.encode(CODE[0]).ids


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CODE, vocab_size=100)
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
