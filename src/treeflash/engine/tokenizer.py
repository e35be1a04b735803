"""A thin wrapper over a Hugging Face `tokenizers` tokenizer.json."""

from __future__ import annotations

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
        chat = path.parent / "chat_template.jinja"
        self.chat_template = chat.read_text() if chat.is_file() else None

    @staticmethod
    def from_model_dir(path: str | Path, eos_token_id: int | None) -> Tokenizer | None:
        f = Path(path) / "tokenizer.json"
        return Tokenizer(f, eos_token_id) if f.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
