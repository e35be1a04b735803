"""Tokenizers: one small interface, two implementations picked by what a model directory holds.

- `HFTokenizer`: a Hugging Face `tokenizers` tokenizer.json (DeepSeek-V3, the shipped pair).
- `TiktokenTokenizer`: Kimi K2's `tiktoken.model` (BPE ranks in tiktoken's base64 format) run
  by the `tiktoken` library with Kimi's pre-tokenizer pattern, and 256 special ids after the
  ranks named by tokenizer_config.json's `added_tokens_decoder`, as Moonshot's
  `tokenization_kimi.py` builds them.

Both keep the checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's
`chat_template`); `engine/chat.py` renders it. `special_tokens` are the strings a chat template
may write for control tokens; `encode_ordinary` encodes text with them as plain text (message
content never becomes a control token).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

# Kimi K2's pre-tokenizer (tokenization_kimi.py's pat_str): Han runs, words with their leading
# non-letter and English contractions, up to 3 digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_RESERVED_SPECIALS = 256  # ids len(ranks) .. len(ranks) + 255
# tiktoken's regex engine recurses on very long runs (openai/tiktoken#195): Kimi's tokenizer
# encodes at most this many chars at a time, and runs of (non-)whitespace of at most this length.
_MAX_CHARS, _MAX_RUN = 400_000, 25_000


class Tokenizer:
    """The interface the engine, the server and the CLI use."""

    eos_token_id: int | None
    vocab_size: int
    chat_template: str | None
    special_tokens: dict[str, int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text becomes its id (as Hugging Face does); add_special_tokens:
        what the tokenizer adds around a sequence (a BOS), if it adds anything."""
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids with special-token text encoded as plain text, nothing added around."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    @staticmethod
    def from_model_dir(path: str | Path, eos_token_id: int | None, tokenizer: str | Path | None = None,
                       chat_template: str | Path | None = None) -> Tokenizer | None:
        """The tokenizer of model directory `path`, or of `tokenizer` (a directory or a
        tokenizer.json / tiktoken.model file) where given; None where there is none.
        chat_template: a template file (or the template text itself) instead of the checkpoint's."""
        source = Path(tokenizer) if tokenizer is not None else Path(path)
        if tokenizer is not None and not source.exists():
            raise ValueError(f"--tokenizer {source}: no such file or directory")
        tok = _load(source, eos_token_id)
        if tok is None and tokenizer is not None:
            raise ValueError(f"--tokenizer {source}: holds neither tokenizer.json nor tiktoken.model")
        if tok is not None and chat_template is not None:
            tok.chat_template = _template_override(chat_template)
        return tok


def _load(source: Path, eos: int | None) -> Tokenizer | None:
    if source.is_file():
        if source.name.endswith(".json"):
            return HFTokenizer(source, eos)
        return TiktokenTokenizer(source, eos)
    if (source / "tokenizer.json").is_file():
        return HFTokenizer(source / "tokenizer.json", eos)
    if (source / "tiktoken.model").is_file():
        return TiktokenTokenizer(source / "tiktoken.model", eos)
    return None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, path: str | Path, eos_token_id: int | None = None):
        path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        # A copy that encodes special tokens' text as text (a per-call flag would race threads).
        self._plain = _HFTokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        self.eos_token_id = eos_token_id
        self.vocab_size = self._tok.get_vocab_size()
        self.chat_template = chat_template_of(path.parent)
        self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_ordinary(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class TiktokenTokenizer(Tokenizer):
    """Kimi K2's tokenizer: tiktoken.model's BPE ranks through `tiktoken.Encoding` with
    `KIMI_PATTERN`; special ids len(ranks) .. len(ranks) + 255, named by the directory's
    tokenizer_config.json (`added_tokens_decoder`), the others `<|reserved_token_{id}|>`.
    decode(skip_special_tokens=True) drops the ids marked `"special": true` and the unnamed ones."""

    def __init__(self, path: str | Path, eos_token_id: int | None = None):
        import tiktoken

        path = Path(path)
        ranks = read_tiktoken_ranks(path)
        added = _added_tokens(path.parent / "tokenizer_config.json")
        base = len(ranks)
        names = {i: added.get(i, (f"<|reserved_token_{i}|>", True)) for i in range(base, base + KIMI_RESERVED_SPECIALS)}
        stray = sorted(set(added) - set(names))
        if stray:
            raise ValueError(f"{path.parent / 'tokenizer_config.json'}: added token id {stray[0]} is outside "
                             f"the special ids {base}..{base + KIMI_RESERVED_SPECIALS - 1} of {path.name}")
        self.special_tokens = {text: i for i, (text, _) in names.items()}
        self._skip = {i for i, (_, special) in names.items() if special}
        self._enc = tiktoken.Encoding(name=path.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)
        self._ids = {i: text for text, i in self.special_tokens.items()}
        self.eos_token_id = eos_token_id
        self.vocab_size = self._enc.n_vocab
        self.chat_template = chat_template_of(path.parent)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [t for piece in _pieces(text) for t in self._enc.encode(piece, allowed_special="all")]

    def encode_ordinary(self, text: str) -> list[int]:
        return [t for piece in _pieces(text) for t in self._enc.encode_ordinary(piece)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        keep = [i for i in ids if 0 <= i < self.vocab_size and not (skip_special_tokens and i in self._skip)]
        return self._enc.decode(keep)

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        ids = self._enc.encode_ordinary(token)
        return ids[0] if len(ids) == 1 and self._enc.decode(ids) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._ids:
            return self._ids[token_id]
        if not 0 <= token_id < self.vocab_size:
            return None
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one `base64(token bytes) rank` a line. Read here rather than through
    `tiktoken.load.load_tiktoken_bpe`, which keeps a copy of any path it reads in a cache keyed
    by the path alone (a changed file at the same path would load stale)."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}: line {n} is not 'base64-token rank': {line[:80]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _added_tokens(config: Path) -> dict[int, tuple[str, bool]]:
    """id -> (text, special) from tokenizer_config.json's added_tokens_decoder."""
    raw = _json(config) if config.is_file() else {}
    out = {}
    for key, entry in (raw.get("added_tokens_decoder") or {}).items():
        if not key.isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{config}: added_tokens_decoder[{key!r}] is not an id with a 'content' string")
        out[int(key)] = (entry["content"], bool(entry.get("special", True)))
    return out


def _pieces(text: str):
    """text in pieces of at most _MAX_CHARS chars and runs of at most _MAX_RUN (non-)space chars."""
    for i in range(0, len(text), _MAX_CHARS):
        chunk, start, run, space = text[i : i + _MAX_CHARS], 0, 0, None
        for j, c in enumerate(chunk):
            s = c.isspace()
            run = run + 1 if s == space else 1
            space = s
            if run > _MAX_RUN:
                yield chunk[start:j]
                start, run = j, 1
        yield chunk[start:]


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else {}


def chat_template_of(model_dir: Path) -> str | None:
    """chat_template.jinja, else the `chat_template` string of tokenizer_config.json."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = _json(config).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _template_override(value: str | Path) -> str:
    """--chat-template: a file, or (as vLLM allows) the template text itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long template string is no valid path
        pass
    text = str(value)
    if "{{" in text or "{%" in text:
        return text
    raise ValueError(f"--chat-template {text}: no such file (nor a Jinja template)")
