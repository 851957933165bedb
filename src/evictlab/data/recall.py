"""A long-range recall task: filler text with a pass key planted at a controlled depth and asked for at
the end (passkey retrieval, as in Mohtashami & Jaggi 2023 / the StreamingLLM paper's evaluations).

Each stream is  prefix + filler[:k] + NEEDLE + filler[k:] + QUERY + ANSWER,  exactly `length` tokens,
with the needle at depth d = k / len(filler). Segments are tokenized separately, so the answer's token
positions are exact for every tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from evictlab.data.dataset import Corpus
from evictlab.errors import ConfigError

NEEDLE = " The pass key is {v}. Remember it. {v} is the pass key. "
QUERY = " What is the pass key? The pass key is"
ANSWER = " {v}"


@dataclass
class RecallBatch:
    tokens: torch.Tensor  # [N, T]
    answer: torch.Tensor  # [N, T-1] bool: steps whose target is an answer token
    answer_start: np.ndarray  # [N] position of the first answer token in the stream
    answer_len: np.ndarray  # [N]
    depth: np.ndarray  # [N] requested needle depth (fraction of the filler before the needle)
    needle_pos: np.ndarray  # [N] position of the needle's first token
    values: list[str]
    documents: list[str]  # [N] the documents each stream's filler comes from (TokenSplit.documents_in)

    def head(self, k: int) -> RecallBatch:
        """The first k streams (make verify --streams k)."""
        arrays = (self.answer_start, self.answer_len, self.depth, self.needle_pos)
        return RecallBatch(
            self.tokens[:k], self.answer[:k], *(a[:k] for a in arrays), self.values[:k], self.documents[:k]
        )


def make_recall_sequence(
    tok,
    prefix: np.ndarray,
    filler: np.ndarray,
    length: int,
    depth: float,
    rng: np.random.Generator,
    digits: int = 5,
    queries: int = 1,
) -> tuple[np.ndarray, int, int, int, str]:
    """One pass-key sequence of exactly `length` tokens: (ids, answer_start, answer_len, needle_pos, key,
    (first, stop) of the filler tokens it holds).

    `queries` > 1 (training) also asks and answers the key at queries - 1 random points between the
    needle and the final question, so the key is copied across many distances, not one.
    """
    v = "".join(str(x) for x in rng.integers(0, 10, size=digits))
    needle, query, answer = tok.encode(NEEDLE.format(v=v)), tok.encode(QUERY), tok.encode(ANSWER.format(v=v))
    body = length - len(prefix) - len(needle) - queries * (len(query) + len(answer))
    if body < 1 or body > len(filler):
        raise ConfigError(
            f"recall: a stream of {length} tokens leaves {body} filler tokens; need 1 .. {len(filler)}"
        )
    start = int(rng.integers(0, len(filler) - body + 1))
    fill = filler[start : start + body]
    k = int(round(depth * body))
    rest = [fill[k:]]
    if queries > 1:  # cut the filler after the needle and ask (and answer) at each cut
        cuts = np.sort(rng.integers(0, body - k + 1, size=queries - 1))
        parts = np.split(fill[k:], cuts)
        rest = [x for part in parts[:-1] for x in (part, query, answer)] + [parts[-1]]
    seq = np.concatenate((prefix, fill[:k], needle, *rest, query, answer)).astype(np.int64)
    return seq, length - len(answer), len(answer), len(prefix) + k, v, (start, start + body)


def recall_streams(
    corpus: Corpus,
    n_per_depth: int,
    length: int,
    sink_token: bool,
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    seed: int = 0,
    split: str = "test",
    digits: int = 5,
) -> RecallBatch:
    """n_per_depth streams of `length` tokens for each depth, filler from the split's text."""
    if not all(0 <= d <= 1 for d in depths) or n_per_depth < 1:
        raise ConfigError(
            f"recall depths must be in [0, 1] and n_per_depth >= 1 (got {depths}, {n_per_depth})"
        )
    rng = np.random.default_rng(seed)
    prefix = np.asarray(corpus.prefix(sink_token), dtype=np.int64)
    sp = corpus.splits[split]
    rows, starts, lens, depth_of, needles, values, docs = [], [], [], [], [], [], []
    for d in depths:
        for _ in range(n_per_depth):
            seq, start, n, needle, v, span = make_recall_sequence(
                corpus.tokenizer, prefix, sp.ids, length, d, rng, digits
            )
            docs.append(sp.documents_in(*span))
            rows.append(seq)
            starts.append(start)
            lens.append(n)
            depth_of.append(d)
            needles.append(needle)
            values.append(v)
    tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
    answer = torch.zeros(tokens.shape[0], length - 1, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        answer[i, s - 1 : s - 1 + n] = True  # step t predicts token t + 1
    arrays = [np.array(a) for a in (starts, lens, depth_of, needles)]
    return RecallBatch(tokens, answer, *arrays, values, docs)
