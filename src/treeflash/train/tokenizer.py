"""Byte-level BPE tokenizer for the embedded code model, built with Hugging Face `tokenizers`.

Ids 0..3 are reserved: BOS, EOS, PAD and the drafter's MASK token. Encoding adds BOS in
front (a post-processor), so `Tokenizer.encode(prompt)` gives what the model was trained
on; documents end with EOS when the corpus is packed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, MASK]  # ids 0, 1, 2, 3 in this order


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    mask: int


def special_ids(tok: Tokenizer) -> SpecialIds:
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if any(i is None for i in ids):
        missing = [t for t, i in zip(SPECIAL_TOKENS, ids) if i is None]
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return SpecialIds(*ids)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE; every byte is in the alphabet, so nothing is ever unknown."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
    if vocab_size > 65535:
        raise ValueError(f"vocab_size must fit uint16 token streams (<= 65535), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 32768) -> Path:
    """Write tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, model_max_length)
    return out / "tokenizer.json"


def write_tokenizer_config(out: Path, model_max_length: int = 32768) -> None:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer {path} not found (expected a tokenizer.json or a folder holding one)")
    return p


def load_tokenizer(path: str | Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(_tokenizer_file(path)))
    special_ids(tok)
    return tok


def copy_tokenizer(path: str | Path, out_dir: str | Path) -> Tokenizer:
    """Reuse an existing tokenizer: OUT/tokenizer.json becomes a byte-for-byte copy of it (so
    token ids match the models trained with it); its tokenizer_config.json is copied when
    it has one next to it, else the default one is written."""
    src = _tokenizer_file(path)
    tok = load_tokenizer(src)
    if tok.get_vocab_size() > 65536:
        raise ValueError(f"tokenizer {path}: vocabulary {tok.get_vocab_size()} does not fit uint16 token streams")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = src.read_bytes()
    (out / "tokenizer.json").write_bytes(raw)
    cfg = src.parent / "tokenizer_config.json"
    if cfg.is_file():
        (out / "tokenizer_config.json").write_bytes(cfg.read_bytes())
    else:
        write_tokenizer_config(out)
    return tok


def encode_documents(tok: Tokenizer, texts: Sequence[str], batch_size: int = 512, desc: str | None = None
                     ) -> list[np.ndarray]:
    """Each text as [BOS, ..., EOS] (uint16). With `desc`, a progress bar of that name (the
    default corpus is ~300 MB: minutes)."""
    from tqdm.auto import tqdm

    eos = special_ids(tok).eos
    out: list[np.ndarray] = []
    with tqdm(total=len(texts), desc=desc, unit="file", disable=desc is None, dynamic_ncols=True) as bar:
        for i in range(0, len(texts), batch_size):
            for enc in tok.encode_batch(list(texts[i : i + batch_size])):
                out.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
            bar.update(min(batch_size, len(texts) - i))
    return out


def _sample_texts(files, sample_bytes: int) -> list[str]:
    out, total = [], 0
    for f in files:  # corpus order is by path hash: a mixed sample
        if total >= sample_bytes:
            break
        out.append(f.text)
        total += len(f.text)
    return out


def build_tokenizer_and_data(
    out_dir: str | Path,
    *,
    corpus_dir: str | Path | None = None,
    vocab_size: int | None = None,
    sample_bytes: int = 20_000_000,
    max_bytes: int | None = None,
    heldout_percent: float = 2.0,
    tokenizer_path: str | Path | None = None,
    progress: bool = True,
    log=print,
) -> dict:
    """Train the tokenizer on a sample of the train split and tokenize the whole corpus.

    With `tokenizer_path`, no BPE is trained: that tokenizer is copied to OUT and used to
    encode the corpus (`vocab_size`, if given, must equal its vocabulary; `sample_bytes` is
    unused). The corpus and its train/held-out split are the same either way.

    Writes OUT/tokenizer.json, OUT/tokenizer_config.json, OUT/data/{train,heldout}.bin
    (uint16 streams of BOS doc EOS), OUT/data/heldout_files.jsonl and OUT/data/manifest.json.
    """
    import hashlib
    import time

    from .corpus import load_corpus, pack, save_stream

    if sample_bytes <= 0:
        raise ValueError(f"--sample-bytes must be > 0, got {sample_bytes}")
    if tokenizer_path is not None:  # fail before the corpus walk, not after it
        reused = load_tokenizer(tokenizer_path)
        if vocab_size is not None and vocab_size != reused.get_vocab_size():
            raise ValueError(f"--vocab-size {vocab_size} but --tokenizer {tokenizer_path} has "
                             f"{reused.get_vocab_size()} tokens (leave --vocab-size out to reuse it)")
    t0 = time.time()
    corpus = load_corpus(corpus_dir, heldout_percent=heldout_percent, max_bytes=max_bytes)
    if not corpus.train or not corpus.heldout:
        raise ValueError(
            f"corpus split is empty (train {len(corpus.train)}, held-out {len(corpus.heldout)} files): "
            "use a larger --corpus or a different --heldout-percent"
        )
    log(f"corpus: {corpus.summary()} ({time.time() - t0:.1f}s)")
    out = Path(out_dir)
    if tokenizer_path is not None:
        tok = copy_tokenizer(tokenizer_path, out)
        log(f"tokenizer: reused {_tokenizer_file(tokenizer_path)}, vocab {tok.get_vocab_size()} "
            f"({time.time() - t0:.1f}s)")
    else:
        by_hash = sorted(corpus.train, key=lambda f: hashlib.sha1(f.relpath.encode()).digest())
        log(f"tokenizer: training a BPE on {min(sample_bytes, corpus.summary()['train_bytes']) / 1e6:.1f} MB ...")
        tok = train_tokenizer(_sample_texts(by_hash, sample_bytes), vocab_size=vocab_size or 4096)
        save_tokenizer(tok, out)
        log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.time() - t0:.1f}s)")
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    streams = {}
    for split, files in (("train", corpus.train), ("heldout", corpus.heldout)):
        tokens = pack(encode_documents(tok, [f.text for f in files], desc=f"encode {split}" if progress else None))
        save_stream(data / f"{split}.bin", tokens)
        streams[split] = int(len(tokens))
    with open(data / "heldout_files.jsonl", "w") as fh:
        for f in corpus.heldout:
            fh.write(json.dumps({"relpath": f.relpath, "text": f.text}) + "\n")
    manifest = {
        **corpus.summary(),
        "vocab_size": tok.get_vocab_size(),
        "tokens": streams,
        "bytes_per_token": corpus.summary()["train_bytes"] / max(1, streams["train"]),
        "heldout_percent": heldout_percent,
        "sample_bytes": None if tokenizer_path is not None else sample_bytes,
        "tokenizer_source": None if tokenizer_path is None else str(_tokenizer_file(tokenizer_path).resolve()),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "max_bytes": max_bytes,
        "seconds": round(time.time() - t0, 1),
    }
    (data / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"tokens: {streams} ({manifest['seconds']}s)")
    return manifest
