"""Training windows: random slices of a split's token stream, each behind the model's prefix, with a share
of pass-key (data/recall.py) and synthetic in-context documents (data/synthetic.py) mixed in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from evictlab.data.dataset import Corpus, TokenSplit
from evictlab.errors import ConfigError

if TYPE_CHECKING:
    from evictlab.config import TrainConfig


class WindowSampler:
    """Random training windows: prefix (<sink>?, <bos>) + a slice of the split's token stream.

    The stream joins documents with <bos>; <bos>/<sink> targets are masked out of the loss, so the
    loss counts text tokens only (and converts exactly to bits per byte).
    """

    def __init__(
        self,
        split: TokenSplit,
        corpus: Corpus,
        seq_len: int,
        sink_token: bool,
        seed: int,
        recall_share: float = 0.0,
        recall_queries: int = 1,
        synthetic_share: float = 0.0,
        synthetic_kind: str = "events",
        synthetic_warmup: int = 0,
    ):
        self.prefix = np.asarray(corpus.prefix(sink_token), dtype=np.int64)
        self.stream = split.stream(corpus.tokenizer.bos_id if corpus.bos else None)
        self.body = seq_len + 1 - len(self.prefix)  # tokens taken from the stream per sample
        if self.body < 2 or len(self.stream) < self.body:
            raise ConfigError(
                f"train.seq_len={seq_len} does not fit: the split has {len(self.stream)} tokens "
                f"and the prefix takes {len(self.prefix)}"
            )
        self.specials = [corpus.tokenizer.bos_id, corpus.tokenizer.sink_id]
        self.rng = np.random.default_rng(seed)
        self.recall_share, self.recall_queries = recall_share, recall_queries
        self.synthetic_share = synthetic_share
        self.synthetic_kind = synthetic_kind  # "events" | "copy" (a SyntheticKind compares equal to its name)
        self.synthetic_warmup, self.batches = synthetic_warmup, 0  # batches drawn so far (= training steps)
        self.split, self.tok, self.seq_len = split, corpus.tokenizer, seq_len

    @classmethod
    def for_training(cls, corpus: Corpus, tc: TrainConfig, sink_token: bool) -> WindowSampler:
        """The training stream of `tc`: its seed, and its mix of pass-key and synthetic documents."""
        mix = ("recall_share", "recall_queries", "synthetic_share", "synthetic_kind", "synthetic_warmup")
        split = corpus.splits["train"]
        return cls(split, corpus, tc.seq_len, sink_token, tc.seed, **{k: getattr(tc, k) for k in mix})

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [batch_size, seq_len] int64; y = -1 where the target is a special token."""
        starts = self.rng.integers(0, len(self.stream) - self.body + 1, size=batch_size)
        rows = [np.concatenate((self.prefix, self.stream[s : s + self.body])) for s in starts]
        if self.recall_share > 0:  # replace a share of the samples by pass-key documents (data/recall.py)
            from evictlab.data.recall import make_recall_sequence

            for i in np.flatnonzero(self.rng.random(batch_size) < self.recall_share):
                depth = float(self.rng.random())
                rows[i] = make_recall_sequence(
                    self.tok,
                    self.prefix,
                    self.split.ids,
                    self.seq_len + 1,
                    depth,
                    self.rng,
                    queries=self.recall_queries,
                )[0]
        warm = self.batches < self.synthetic_warmup  # the curriculum's first steps: synthetic only
        self.batches += 1
        if self.synthetic_share > 0 or warm:  # replace a share by synthetic in-context documents
            from evictlab.data.synthetic import make_copy_sequence, make_synthetic_sequence

            share = 1.0 if warm else self.synthetic_share
            for i in np.flatnonzero(self.rng.random(batch_size) < share):
                args = (self.tok, self.prefix, self.split.ids, self.seq_len + 1, self.rng)
                if self.synthetic_kind == "copy":
                    rows[i] = make_copy_sequence(*args, filler_max=0 if warm else 48)
                else:
                    rows[i] = make_synthetic_sequence(*args)
        seq = torch.from_numpy(np.stack(rows))
        x, y = seq[:, :-1], seq[:, 1:].clone()
        y[torch.isin(y, torch.tensor(self.specials))] = -1
        return x, y
