"""A thin wrapper over a Hugging Face `tokenizers` tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path, eos_token_id: int | None = None):
        path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        self.eos_token_id = eos_token_id
        self.vocab_size = self._tok.get_vocab_size()
        self.chat_template = _chat_template(path.parent)

    @staticmethod
    def from_model_dir(path: str | Path, eos_token_id: int | None) -> Tokenizer | None:
        f = Path(path) / "tokenizer.json"
        return Tokenizer(f, eos_token_id) if f.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens=False for text a chat template already rendered."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def _chat_template(model_dir: Path) -> str | None:
    """chat_template.jinja, else the `chat_template` string of tokenizer_config.json."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text()).get("chat_template")
        except json.JSONDecodeError:
            raise ValueError(f"{config}: not valid JSON") from None
        if isinstance(template, str):
            return template
    return None
