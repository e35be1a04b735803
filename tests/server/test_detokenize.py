"""Streaming detokenisation: token by token, the deltas add up to the full text and never
carry half a character (the shipped byte-level tokenizer splits emoji across tokens)."""

from __future__ import annotations

import pytest

from treeflash.engine.llm import EMBEDDED
from treeflash.engine.tokenizer import HFTokenizer as Tokenizer
from treeflash.server.async_engine import Event
from treeflash.server.serving import Choice

pytestmark = pytest.mark.slow

TEXT = "def f(x):\n    return 'héllo 🙂 wörld — ∑x²'  # ünïcode\n"


@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_add_up_to_the_full_text(step):
    tok = Tokenizer(EMBEDDED / "target" / "tokenizer.json")
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(len(ids)))  # characters split across tokens
    choice, deltas = Choice(holdback=0, token_ids=[]), []
    for i in range(0, len(ids), step):
        deltas.append(choice.advance(Event(0, ids[i : i + step]), tok.decode))
    deltas.append(choice.advance(Event(0, [], finished=True, finish_reason="length"), tok.decode))
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
