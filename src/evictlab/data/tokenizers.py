"""Tokenizers: byte-level (no files) and byte-level BPE trained with HF `tokenizers`, cached by content hash.

Both reserve two special ids: ``<bos>`` (starts every sample and stream) and ``<sink>`` (the
optional learnable dedicated attention-sink token).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.errors import ConfigError
from evictlab.store import atomic_path, file_lock, stable_hash

BOS, SINK = "<bos>", "<sink>"


class TokenizerKind(str, Enum):
    byte = "byte"
    bpe = "bpe"
    hf = "hf"  # a pretrained checkpoint's own tokenizer (transformers AutoTokenizer)
    gguf = "gguf"  # a GGUF file's own tokenizer (models/gguf.py), cached by the file's sha256


@dataclass
class TokenizerConfig:
    kind: TokenizerKind = TokenizerKind.byte
    vocab_size: int = 2048  # BPE only (byte-level is always 256 + 2 specials)
    name_or_path: str | None = None  # hf and gguf only: set from model.name_or_path

    def __post_init__(self) -> None:
        self.kind = TokenizerKind(self.kind)
        if self.kind in (TokenizerKind.hf, TokenizerKind.gguf) and not self.name_or_path:
            raise ConfigError(
                f"tokenizer.kind={self.kind.value} needs tokenizer.name_or_path (set by the model)"
            )
        if self.kind is TokenizerKind.bpe and not 260 <= self.vocab_size <= 65535:
            raise ConfigError(f"tokenizer.vocab_size={self.vocab_size} must be in [260, 65535] for BPE")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; <bos> = 256, <sink> = 257."""

    vocab_size = 258
    bos_id, sink_id = 256, 257

    @property
    def spec(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        specials = {self.bos_id: BOS, self.sink_id: SINK}
        out, buf = [], bytearray()
        for i in ids:
            if i in specials:
                out.append(buf.decode("utf-8", errors="replace") + specials[i])
                buf = bytearray()
            else:
                buf.append(int(i))
        return "".join(out) + buf.decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) from a `tokenizers` JSON file."""

    def __init__(self, path: Path, spec: dict[str, Any]):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.sink_id = self._tok.token_to_id(BOS), self._tok.token_to_id(SINK)
        self.spec = spec

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GGUFTokenizer(BPETokenizer):
    """A GGUF file's byte-level BPE (models/gguf.py: `tokenizer_json`), stored once as JSON beside its BOS
    id. <bos> is the file's BOS token; there is no dedicated <sink> token."""

    def __init__(self, path: Path, spec: dict[str, Any]):
        from tokenizers import Tokenizer

        stored = json.loads(path.read_text())
        self._tok = Tokenizer.from_str(stored["tokenizer"])
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.sink_id = int(stored["bos_id"]), None
        self.spec = spec


def gguf_tokenizer(name_or_path: str, cache_dir: Path) -> GGUFTokenizer:
    """The tokenizer of the GGUF file `name_or_path`, read from the file once and cached by its sha256."""
    from evictlab.models import gguf

    file = gguf.locate(name_or_path)
    spec = {"kind": "gguf", "sha256": file.sha256, "converter": gguf.CONVERTER_VERSION}
    path = cache_dir / f"gguf-{stable_hash(spec)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path):
        if not path.exists():
            text, bos = gguf.read_tokenizer(file)
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps({"bos_id": bos, "tokenizer": text}))
    return GGUFTokenizer(path, spec)


class HFTokenizer:
    """A pretrained checkpoint's tokenizer. <bos> follows the checkpoint: its BOS token, else its EOS
    (GPT-2 and Pythia start documents with <|endoftext|>). It has no dedicated <sink> token."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        from evictlab.models.hf import resolve

        path = resolve(name_or_path)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"no usable tokenizer in {path} ({first})") from None
        self.vocab_size = len(self._tok)
        bos = self._tok.bos_token_id if self._tok.bos_token_id is not None else self._tok.eos_token_id
        self.bos_id, self.sink_id = bos, None
        self.spec = {"kind": "hf", "name_or_path": str(name_or_path), "vocab_size": self.vocab_size}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        ids = self._tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(i, dtype=np.int64) for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def train_bpe(texts: list[str], vocab_size: int, dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, SINK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),  # the library's own bars, on a terminal
    )
    chars = sum(len(t) for t in texts) / 1e6
    print(
        f"training a BPE tokenizer ({vocab_size} tokens) on {len(texts):,} documents "
        f"({chars:.1f}M characters); cached after this",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    print(f"BPE tokenizer trained in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    with atomic_path(dest) as tmp:
        tok.save(str(tmp))


def build_tokenizer(
    cfg: TokenizerConfig, train_texts: list[str], train_hash: str, cache_dir: Path
) -> ByteTokenizer | BPETokenizer | GGUFTokenizer | HFTokenizer:
    """The tokenizer for a corpus; BPE is trained on the train split once and cached by its hash."""
    if cfg.kind is TokenizerKind.byte:
        return ByteTokenizer()
    if cfg.kind is TokenizerKind.hf:
        return HFTokenizer(cfg.name_or_path)
    if cfg.kind is TokenizerKind.gguf:
        return gguf_tokenizer(cfg.name_or_path, cache_dir)
    spec = {"kind": "bpe", "vocab_size": cfg.vocab_size, "train_hash": train_hash}
    path = cache_dir / f"bpe-{stable_hash(spec)}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path):
            if not path.exists():
                train_bpe(train_texts, cfg.vocab_size, path)
    return BPETokenizer(path, spec)
