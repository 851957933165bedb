"""Tokenized corpora: split by document, tokenized once, cached on disk by content hash."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evictlab.data.corpora import SPLITS, DatasetConfig, content_hash, load_documents, split_documents
from evictlab.data.tokenizers import BPETokenizer, ByteTokenizer, TokenizerConfig, build_tokenizer
from evictlab.errors import ConfigError, DataError
from evictlab.store import atomic_path, stable_hash

log = logging.getLogger(__name__)
TOKENS_FORMAT = 1  # bump when the on-disk layout changes


@dataclass
class TokenSplit:
    """The documents of one split, tokenized without specials and concatenated."""

    ids: np.ndarray  # [N] token ids
    offsets: np.ndarray  # [n_docs + 1] document boundaries into ids
    doc_ids: list[str]
    n_bytes: int  # UTF-8 bytes of the split's text (for bits per byte)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / max(1, self.n_tokens)

    def doc(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def documents_in(self, start: int, stop: int, sep: bool = False) -> str:
        """The documents that tokens [start, stop) of `ids` (of `stream(sep)` with sep=True: each document
        one token longer) come from: "id@k | id | ...", k the first one's token offset where it is not 0."""
        ends = self.offsets[1:] + (np.arange(1, self.n_docs + 1) if sep else 0)  # exclusive, per document
        starts = np.concatenate(([0], ends[:-1]))
        first, last = np.searchsorted(ends, start, side="right"), np.searchsorted(starts, stop, side="left")
        k = start - int(starts[first]) - (1 if sep else 0)  # the first one's separator is at offset -1
        names = [self.doc_ids[i] for i in range(first, last)]
        return " | ".join([f"{names[0]}@{k}" if k > 0 else names[0], *names[1:]])

    def stream(self, sep: int | None) -> np.ndarray:
        """All documents as one array, each preceded by `sep` (e.g. <bos>) when given."""
        if sep is None:
            return self.ids
        parts = [np.concatenate(([sep], self.doc(i))) for i in range(self.n_docs)]
        return np.concatenate(parts) if parts else self.ids


class Splits(Mapping):
    """split name -> TokenSplit, each tokenized on first use and cached in its own file
    (`<name>-<data_hash>.<split>.npz`): a pretrained model that only evaluates never tokenizes the
    training split (for SmolLM2 on the manual pages, about nine tenths of the tokenizer's time)."""

    def __init__(self, name: str, docs: dict, n_bytes: dict, tokenizer, prefix: Path, min_tokens: int):
        self.name, self._docs, self._n_bytes, self._tokenizer = name, docs, n_bytes, tokenizer
        self.prefix, self.min_tokens = prefix, min_tokens
        self._done: dict[str, TokenSplit] = {}

    def path(self, split: str) -> Path:
        return self.prefix.with_name(f"{self.prefix.name}.{split}.npz")

    def __getitem__(self, split: str) -> TokenSplit:
        if split not in self._docs:
            raise KeyError(split)
        if split not in self._done:
            self._done[split] = self._load_or_encode(split)
        return self._done[split]

    def __iter__(self):
        return iter(self._docs)

    def __len__(self) -> int:
        return len(self._docs)

    def _load_or_encode(self, split: str) -> TokenSplit:
        path, sp = self.path(split), None
        if path.exists():
            try:
                sp = _load(path)
            except Exception as e:  # noqa: BLE001 - a damaged cache file is rebuilt, never trusted
                log.warning("token cache %s is unreadable (%s); rebuilding it", path, e)
        cached = sp is not None
        if not cached:
            docs = self._docs[split]
            encoded = self._tokenizer.encode_batch([d.text for d in docs])
            lengths = np.array([len(e) for e in encoded], dtype=np.int64)
            ids = np.concatenate(encoded) if encoded else np.zeros(0, dtype=np.int64)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            sp = TokenSplit(ids, offsets, [d.id for d in docs], self._n_bytes[split])
        _check_sizes(self.name, {split: sp.n_tokens + sp.n_docs}, self.min_tokens)  # before saving a new one
        if not cached:
            _save(path, sp)
        return sp


@dataclass
class Corpus:
    name: str
    tokenizer: ByteTokenizer | BPETokenizer
    splits: Splits | dict[str, TokenSplit]
    split_hashes: dict[str, str]
    data_hash: str  # hash of the split contents + tokenizer: identifies the training data
    bos: bool = True

    def prefix(self, sink_token: bool) -> list[int]:
        """The tokens every sample/stream starts with: [<sink>] if the model has one, then [<bos>]."""
        if sink_token and self.tokenizer.sink_id is None:
            raise ConfigError("model.sink_token=true needs a tokenizer with a <sink> token (byte or bpe)")
        if self.bos and self.tokenizer.bos_id is None:
            raise ConfigError("the tokenizer has neither a BOS nor an EOS token: set dataset.bos=false")
        return ([self.tokenizer.sink_id] if sink_token else []) + (
            [self.tokenizer.bos_id] if self.bos else []
        )


def _check_sizes(corpus_name: str, sizes: dict[str, int], min_tokens: int) -> None:
    """The train and val splits (those of `sizes`) must each hold one sequence."""
    for split in ("train", "val"):
        if split in sizes and sizes[split] < min_tokens:
            fix = (
                "it holds no documents (a pinned corpus is all held out: evaluate an imported model on it, "
                "or train on another dataset)"
                if sizes[split] == 0
                else "use a bigger corpus or a shorter train.seq_len"
            )
            raise DataError(
                f"dataset {corpus_name!r}: the {split} split has {sizes[split]} tokens, fewer than one "
                f"sequence needs ({min_tokens}); {fix}"
            )


def _save(path: Path, sp: TokenSplit) -> None:
    arrays = {
        "ids": sp.ids.astype(np.uint16 if sp.ids.max(initial=0) < 65536 else np.int32),
        "offsets": sp.offsets.astype(np.int64),
        "doc_ids": np.array(sp.doc_ids, dtype=str),
        "n_bytes": np.array(sp.n_bytes, dtype=np.int64),
    }
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def _load(path: Path) -> TokenSplit:
    with np.load(path, allow_pickle=False) as z:
        return TokenSplit(
            ids=z["ids"].astype(np.int64),
            offsets=z["offsets"],
            doc_ids=[str(x) for x in z["doc_ids"]],
            n_bytes=int(z["n_bytes"]),
        )


def load_corpus(
    data_cfg: DatasetConfig,
    tok_cfg: TokenizerConfig,
    outputs: Path,
    min_tokens: int = 2,
) -> Corpus:
    """Documents -> split -> tokenizer -> token arrays, each cached under outputs/cache (a split's tokens
    when it is first used: `Splits`).

    `min_tokens`: the train and val splits must each hold at least this many tokens (one sequence);
    checked on their bytes before anything is written, and on their tokens before a split is cached.
    """
    docs = load_documents(data_cfg, outputs / "cache" / "documents")
    by_split = split_documents(docs, data_cfg)
    n_bytes = {s: sum(len(d.text.encode("utf-8")) for d in ds) for s, ds in by_split.items()}
    # Tokens never outnumber bytes, so a corpus too small in bytes fails before a tokenizer is trained.
    _check_sizes(data_cfg.name, {s: n_bytes[s] + len(by_split[s]) for s in SPLITS}, min_tokens)
    split_hashes = {s: content_hash(ds) for s, ds in by_split.items()}
    cache = outputs / "cache"
    tokenizer = build_tokenizer(
        tok_cfg, [d.text for d in by_split["train"]], split_hashes["train"], cache / "tokenizers"
    )
    data_hash = stable_hash({"splits": split_hashes, "tokenizer": tokenizer.spec, "format": TOKENS_FORMAT})
    prefix = cache / "tokens" / f"{data_cfg.name}-{data_hash}"
    splits = Splits(data_cfg.name, by_split, n_bytes, tokenizer, prefix, min_tokens)
    return Corpus(data_cfg.name, tokenizer, splits, split_hashes, data_hash, data_cfg.bos)
