"""Synthetic in-context training documents: natural filler text with jobs that only the context can solve.

Mixed into training at `train.synthetic_share`, they give attention heads a sparse job (copy this, recall
that), which is what makes small models grow copying heads and, on every other token, park their
attention on the first position: the attention sink (Guo et al., "Active-Dormant Attention Heads";
Bietti et al., "Birth of a Transformer"; Olsson et al., induction heads). Evaluation stays on natural text.

A document is  prefix + filler, with three kinds of event spliced in at random points:

* **repeat**: a random printable segment (8-64 characters) that occurs 2-4 times in the document;
* **trigger**: 2-4 trigger characters (control bytes, absent from natural text) each followed by the same
  random character every time within the document (an in-context bigram, a different one per document);
* **key-value**: records ``@ab=1234;`` and later queries ``@ab?1234;`` of a recorded key.

Each document has exactly the requested number of tokens and is a pure function of the generator's state.

`make_copy_sequence` (train.synthetic_kind=copy) is the denser job: the whole document is random printable
segments (16-48 characters), each written 2-3 times in a row with 0..`filler_max` natural tokens before
each copy, so about half of its tokens can only be predicted by copying.
"""

from __future__ import annotations

import string

import numpy as np

PRINTABLE = string.ascii_letters + string.digits + string.punctuation.replace("@", "").replace(";", "")
TRIGGERS = [chr(c) for c in (*range(1, 9), *range(14, 32))]  # control bytes (no \t \n \r etc.)


def _random_string(rng: np.random.Generator, n: int, alphabet: str = PRINTABLE) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))


class _Document:
    """The events of one document: its repeated segment, its trigger bigrams and its key-value store."""

    def __init__(self, tok, rng: np.random.Generator):
        self.tok, self.rng = tok, rng
        self.segment = tok.encode(_random_string(rng, int(rng.integers(8, 65))))
        chars = rng.choice(len(TRIGGERS), size=int(rng.integers(2, 5)), replace=False)
        self.bigrams = [tok.encode(TRIGGERS[c] + PRINTABLE[int(rng.integers(len(PRINTABLE)))]) for c in chars]
        self.store: dict[str, str] = {}

    def event(self) -> np.ndarray:
        """One event, drawn uniformly from repeat, trigger and key-value (a query needs a stored key)."""
        kind = int(self.rng.integers(0, 3))
        if kind == 0:
            return self.segment
        if kind == 1:
            return self.bigrams[int(self.rng.integers(len(self.bigrams)))]
        if self.store and self.rng.random() < 0.5:
            key = list(self.store)[int(self.rng.integers(len(self.store)))]
            return self.tok.encode(f"@{key}?{self.store[key]};")
        key = _random_string(self.rng, 2, string.ascii_lowercase)
        self.store[key] = _random_string(self.rng, 4, string.digits)
        return self.tok.encode(f"@{key}={self.store[key]};")


def make_synthetic_sequence(
    tok, prefix: np.ndarray, filler: np.ndarray, length: int, rng: np.random.Generator
) -> np.ndarray:
    """One synthetic document of exactly `length` tokens: prefix, then natural filler chunks (8-96
    tokens, from a random place in `filler`) alternating with events."""
    doc = _Document(tok, rng)
    parts, n = [np.asarray(prefix, dtype=np.int64)], len(prefix)
    start = int(rng.integers(0, max(1, len(filler) - length)))
    while n < length:
        k = int(rng.integers(8, 97))
        chunk = filler[start : start + k]
        start = start + k if start + k < len(filler) - 96 else 0
        event = doc.event()
        parts += [chunk, event]
        n += len(chunk) + len(event)
    return np.concatenate(parts).astype(np.int64)[:length]


def make_copy_sequence(
    tok, prefix: np.ndarray, filler: np.ndarray, length: int, rng: np.random.Generator, filler_max: int = 48
) -> np.ndarray:
    """One copy document of exactly `length` tokens: prefix, then random segments each repeated 2-3 times,
    with 0..filler_max tokens of natural text (a random place in `filler`) before each copy."""
    parts, n = [np.asarray(prefix, dtype=np.int64)], len(prefix)
    while n < length:
        segment = np.asarray(tok.encode(_random_string(rng, int(rng.integers(16, 49)))), dtype=np.int64)
        start = int(rng.integers(0, max(1, len(filler) - 3 * filler_max - 1)))
        for _ in range(int(rng.integers(2, 4))):
            k = int(rng.integers(0, filler_max + 1))
            parts += [np.asarray(filler[start : start + k], dtype=np.int64), segment]
            start, n = start + k, n + k + len(segment)
    return np.concatenate(parts)[:length]
