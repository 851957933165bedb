"""Evaluation streams: rows of held-out tokens, each starting with the corpus prefix (<sink>?, <bos>)."""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch

from evictlab.data.dataset import Corpus
from evictlab.errors import ConfigError


class StreamSource(str, Enum):
    documents = "documents"  # each stream is one document from its start (documents must be long enough)
    concat = "concat"  # the split's documents joined by <bos>, cut into consecutive chunks


def eval_streams(
    corpus: Corpus,
    n_streams: int,
    length: int,
    sink_token: bool,
    source: StreamSource | str = "concat",
    split: str = "test",
    seed: int | None = None,
) -> torch.Tensor:
    """[n_streams, length] token ids, each row starting with the corpus prefix (<sink>?, <bos>).

    `documents`: the first n_streams long-enough documents (a seed shuffles which ones). `concat`:
    consecutive chunks of the split's text, from its start (or from a seeded random offset).
    """
    source = StreamSource(source)
    prefix = corpus.prefix(sink_token)
    body = length - len(prefix)
    if body < 1 or n_streams < 1:
        raise ConfigError(
            f"eval.stream_len={length} and eval.n_streams={n_streams} must leave >= 1 text token"
        )
    sp = corpus.splits[split]
    if source is StreamSource.documents:
        rows = [sp.doc(i)[:body] for i in range(sp.n_docs) if len(sp.doc(i)) >= body]
        if seed is not None:
            rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
        if len(rows) < n_streams:
            raise ConfigError(
                f"eval.stream_len={length} is longer than the documents: only {len(rows)} of the {sp.n_docs} "
                f"{split} documents of {corpus.name!r} hold {body} tokens, eval.n_streams={n_streams} needed "
                "(use eval.stream_source=concat, a shorter stream or fewer streams)"
            )
    else:
        text = sp.stream(corpus.tokenizer.bos_id if corpus.bos else None)
        available = len(text) // body
        if available < n_streams:
            raise ConfigError(
                f"eval.stream_len={length} x eval.n_streams={n_streams} is longer than the {split} documents "
                f"of {corpus.name!r}: they hold {len(text)} tokens, {available} stream(s) of this length"
            )
        start = (
            0
            if seed is None
            else int(np.random.default_rng(seed).integers(0, len(text) - n_streams * body + 1))
        )
        rows = [text[start + i * body : start + (i + 1) * body] for i in range(n_streams)]
    out = np.stack([np.concatenate((prefix, r)) for r in rows[:n_streams]]).astype(np.int64)
    return torch.from_numpy(out)
