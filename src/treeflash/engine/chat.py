"""Chat prompts: a Jinja chat template rendered in a sandbox, and its text encoded so that the
tokenizer's special tokens come only from what the template wrote, never from message content.

The template is rendered twice: with the messages, and with each content replaced by a marker.
Where putting the contents back at the markers gives the same text, the template passed content
through verbatim and the contents' spans are known: special-token text inside them is encoded as
plain text, everywhere else as the token (what Kimi's tokenizer does segment by segment). A
template that changes content (e.g. `| trim`) has no such spans; then content holding a special
token's text is refused rather than turned into a control token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from treeflash.engine.tokenizer import Tokenizer

# Used when the tokenizer has no chat template: one "role: content" line per message, then
# "assistant:" for the model to continue. Plain text, so it works with any tokenizer.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use code points around a message index


class ChatTemplateError(ValueError):
    """The template refused the messages (`raise_exception`, a Jinja error) or a message
    cannot be encoded safely."""


@dataclass
class ChatTemplate:
    """A compiled chat template; `source` is "tokenizer" (the checkpoint's or --chat-template)
    or "plain" (`PLAIN_CHAT_TEMPLATE`: the tokenizer's BOS, if it adds one, goes first)."""

    template: object
    source: str
    tokenizer: Tokenizer | None
    token_texts: dict[str, str]  # bos_token, eos_token: the template's variables

    @staticmethod
    def for_tokenizer(tokenizer: Tokenizer | None, bos_id: int | None = None, eos_id: int | None = None,
                      on_error=None) -> ChatTemplate:
        """The tokenizer's template, or the plain one where it has none or it does not compile
        (then `on_error(message)` is told why). bos_id / eos_id: the model's, whose text the
        template sees as `bos_token` / `eos_token`."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        names = {"bos_token": bos_id, "eos_token": eos_id}
        texts = {k: (tokenizer.id_to_token(i) or "") if tokenizer and i is not None else "" for k, i in names.items()}
        text = getattr(tokenizer, "chat_template", None)
        if text:
            try:
                return ChatTemplate(env.from_string(text), "tokenizer", tokenizer, texts)
            except TemplateError as e:
                if on_error is not None:
                    on_error(f"the tokenizer's chat template does not compile ({e}); using the plain one")
        return ChatTemplate(env.from_string(PLAIN_CHAT_TEMPLATE), "plain", tokenizer, texts)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **extra) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.token_texts, **extra)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from None

    def encode(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (see the module docstring)."""
        tok = self.tokenizer
        if tok is None:
            raise ChatTemplateError("this model has no tokenizer: send prompts as token ids")
        text = self.render(messages, add_generation_prompt)
        spans = self._content_spans(messages, add_generation_prompt, text)
        if spans is None:
            _refuse_special_content(tok, messages)
            spans = []
        ids = encode_with_specials(tok, text, spans)
        if self.source == "plain":  # a real template writes BOS itself; the plain one does not
            ids = tok.encode("", add_special_tokens=True) + ids
        return ids

    def _content_spans(self, messages, add_generation_prompt, text) -> list[tuple[int, int]] | None:
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        try:
            layout = self.render(marked, add_generation_prompt)
        except ChatTemplateError:
            return None
        spans, parts, at, end = [], [], 0, 0
        for m in _MARK.finditer(layout):
            content = messages[int(m.group(1))]["content"]
            parts.append(layout[end : m.start()])
            at += m.start() - end
            spans.append((at, at + len(content)))
            parts.append(content)
            at, end = at + len(content), m.end()
        parts.append(layout[end:])
        return spans if "".join(parts) == text else None


def encode_with_specials(tok: Tokenizer, text: str, plain_spans: list[tuple[int, int]]) -> list[int]:
    """Token ids of `text`: special-token text outside `plain_spans` becomes its token, the rest
    (message content included) is encoded as plain text."""
    specials = sorted(tok.special_tokens, key=len, reverse=True)
    if not specials:
        return tok.encode_ordinary(text)
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    ids, pos = [], 0
    for m in pattern.finditer(text):
        if any(m.start() < b and a < m.end() for a, b in plain_spans):
            continue
        ids += tok.encode_ordinary(text[pos : m.start()]) + [tok.special_tokens[m.group()]]
        pos = m.end()
    return ids + tok.encode_ordinary(text[pos:])


def _refuse_special_content(tok: Tokenizer, messages: list[dict[str, str]]) -> None:
    for i, m in enumerate(messages):
        hit = next((s for s in tok.special_tokens if s in m["content"]), None)
        if hit is not None:
            raise ChatTemplateError(
                f"messages[{i}] contains {hit!r}, a special token of this tokenizer, and this chat "
                "template does not pass message content through unchanged, so it cannot be kept as text")


def _raise_template_error(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
