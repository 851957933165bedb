"""Evaluation streams: rows of held-out tokens, each starting with the corpus prefix (<sink>?, <bos>)."""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch

from evictlab.data.dataset import Corpus
from evictlab.errors import ConfigError


class StreamSource(str, Enum):
    documents = "documents"  # each stream is one document from its start (documents must be long enough)
    # each stream one document from a seeded offset inside it (position 0 is not the page's first word),
    # chosen among the documents that hold stream_len tokens: with or without <bos>, the same text
    offsets = "offsets"
    concat = "concat"  # the split's documents joined by <bos>, cut into consecutive chunks


def eval_streams(
    corpus: Corpus,
    n_streams: int,
    length: int,
    sink_token: bool,
    source: StreamSource | str = "concat",
    split: str = "test",
    seed: int | None = None,
    return_documents: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """[n_streams, length] token ids, each row starting with the corpus prefix (<sink>?, <bos>); with
    `return_documents`, also for each row the documents its text comes from (TokenSplit.documents_in).

    `documents`: the first n_streams long-enough documents (a seed shuffles which ones); `offsets`: the
    same, each from a seeded token offset inside it. `concat`: consecutive chunks of the split's text, from
    its start (or from a seeded random offset).
    """
    source = StreamSource(source)
    prefix = corpus.prefix(sink_token)
    body = length - len(prefix)
    if body < 1 or n_streams < 1:
        raise ConfigError(
            f"eval.stream_len={length} and eval.n_streams={n_streams} must leave >= 1 text token"
        )
    sp = corpus.splits[split]
    if source is StreamSource.concat:
        rows, docs = _concat_rows(corpus, split, n_streams, length, body, seed)
    else:
        rows, docs = _document_rows(corpus, split, source, length, body, seed)
        if len(rows) < n_streams:
            least = length if source is StreamSource.offsets else body
            raise ConfigError(
                f"eval.stream_len={length} is longer than the documents: only {len(rows)} of the {sp.n_docs} "
                f"{split} documents of {corpus.name!r} hold {least} tokens, eval.n_streams={n_streams} "
                "needed (use eval.stream_source=concat, a shorter stream or fewer streams)"
            )
    out = torch.from_numpy(np.stack([np.concatenate((prefix, r)) for r in rows[:n_streams]]).astype(np.int64))
    return (out, docs[:n_streams]) if return_documents else out


def _document_rows(
    corpus: Corpus, split: str, source: StreamSource, length: int, body: int, seed: int | None
):
    """One row of `body` tokens per document long enough (in a seeded order when seed is set), from its
    start (`documents`) or from a seeded offset (`offsets`, documents of >= `length` tokens: the same draw
    with or without the prefix); with each row's document id (`id@offset` past the start)."""
    sp = corpus.splits[split]
    least = length if source is StreamSource.offsets else body
    long = [i for i in range(sp.n_docs) if len(sp.doc(i)) >= least]
    if seed is not None:
        long = [long[i] for i in np.random.default_rng(seed).permutation(len(long))]
    starts = [0] * len(long)
    if source is StreamSource.offsets:  # one offset per document
        u = np.random.default_rng([0 if seed is None else seed, 1]).random(len(long))
        starts = [int(x * (len(sp.doc(i)) - length + 1)) for x, i in zip(u, long, strict=True)]
    rows = [sp.doc(i)[k : k + body] for i, k in zip(long, starts, strict=True)]
    docs = [f"{sp.doc_ids[i]}@{k}" if k else sp.doc_ids[i] for i, k in zip(long, starts, strict=True)]
    return rows, docs


def _concat_rows(corpus: Corpus, split: str, n_streams: int, length: int, body: int, seed: int | None):
    """Consecutive chunks of `body` tokens of the split's text (documents joined by BOS when the corpus
    has one), from its start or a seeded offset; with the documents each chunk covers."""
    sp = corpus.splits[split]
    sep = corpus.tokenizer.bos_id if corpus.bos else None
    text = sp.stream(sep)
    available = len(text) // body
    if available < n_streams:
        raise ConfigError(
            f"eval.stream_len={length} x eval.n_streams={n_streams} is longer than the {split} documents "
            f"of {corpus.name!r}: they hold {len(text)} tokens, {available} stream(s) of this length"
        )
    start = (
        0 if seed is None else int(np.random.default_rng(seed).integers(0, len(text) - n_streams * body + 1))
    )
    spans = [(start + i * body, start + (i + 1) * body) for i in range(n_streams)]
    return [text[a:b] for a, b in spans], [sp.documents_in(a, b, sep is not None) for a, b in spans]
