"""A tiny checkpoint with a tokenizer, and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

from hf_checkpoints import write_checkpoint

TINY = dict(num_hidden_layers=2, max_position_embeddings=2048)  # small enough for a CPU under load


def write_tiny_model(path: Path, **overrides) -> Path:
    write_checkpoint(path, **{**TINY, **overrides})
    add_tokenizer(path)
    return path


def add_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE whose vocabulary fits the 96-token test model (as in
    tests/engine/test_llm.py); "</s>" is id 1, the model's eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["def f(x): return x + 1", "hello world"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # The corpus' own symbols first, then a fixed (sorted) fill: deterministic, <= 80 symbols.
    used = sorted(
        {c for text in corpus for piece, _ in byte_level.pre_tokenize_str(text) for c in piece}
    )
    alphabet = (used + [c for c in sorted(pre_tokenizers.ByteLevel.alphabet()) if c not in used])[
        :80
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=96, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus * 10, trainer)
    assert tok.get_vocab_size() <= 96
    tok.save(str(path / "tokenizer.json"))


@contextmanager
def running_server(llm, **config):
    """Serve `llm` with ServerConfig(**config) from a thread; yields (base_url, app, server)."""
    from treeflash.server import ServerConfig, create_app, make_server

    config.setdefault("model_name", "tiny")
    config.setdefault("log_interval", 0)
    app = create_app(llm, ServerConfig(**config))
    server = make_server(app, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(30)
