"""Attention-sink metrics of a model (a property of the model, measured the same way in every run and in
checkpoint meta).

* `sink_head_fraction`: Gu et al.'s Sink_1^0.3 ("When Attention Sink Emerges in Language Models", ICLR
  2025): alpha_h = the attention on position 0, averaged over every query of sequences of 64 tokens of
  held-out text; a (layer, head) is a sink head when alpha_h > 0.3; the metric is the share of sink heads.
* `sink_head_fraction_deep`: the same over layers >= 1 (Gu and StreamingLLM find no sinks in layer 0).
* per layer: the attention the last query puts on position 0 at the training context (StreamingLLM,
  App. F), mean over heads and sequences.

Streams start with the corpus prefix, so position 0 is <bos> (or <sink>). The text comes from a fixed
seed, so the numbers depend on the model only.
"""

from __future__ import annotations

import pandas as pd
import torch

from evictlab.data.dataset import Corpus
from evictlab.data.streams import eval_streams
from evictlab.eval.full import full_reference
from evictlab.models.gpt import GPT

SINK_THRESHOLD = 0.3  # Gu et al.'s epsilon
SINK_SEQ_LEN = 64  # tokens per sequence for alpha_h (position 0 included)
SINK_SEQS = 64  # sequences for alpha_h
LAST_QUERY_SEQS = 8  # sequences at the training context for the last query's attention


def _first_position_attention(model: GPT, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [B, H, n]: each query's attention on position 0 (tokens [B, n+1])."""
    ref = full_reference(model, tokens, attention=True)
    return [a[..., 0] for a in ref.attn]


@torch.no_grad()
def sink_metrics(model: GPT, corpus: Corpus, context: int, sink_token: bool, split: str = "test"):
    """(scalars, per-layer/per-head rows for layers.parquet) of the model's attention sink."""
    device = next(model.parameters()).device
    short = eval_streams(corpus, SINK_SEQS, SINK_SEQ_LEN + 1, sink_token, "concat", split, seed=0)
    alpha = torch.stack([a.mean(dim=(0, 2)) for a in _first_position_attention(model, short.to(device))])
    sinks = (alpha > SINK_THRESHOLD).float()  # [L, H]
    n_long = min(LAST_QUERY_SEQS, max(1, len(corpus.splits[split].ids) // (context + 1) - 1))
    long = eval_streams(corpus, n_long, context + 1, sink_token, "concat", split, seed=0)
    last = [a[:, :, -1].mean().item() for a in _first_position_attention(model, long.to(device))]
    scalars = {
        "sink_head_fraction": float(sinks.mean()),
        "sink_head_fraction_deep": float(sinks[1:].mean()) if len(sinks) > 1 else float("nan"),
    }
    rows = [
        {"layer": l, "head": None, "metric": "last_query_first_mass", "value": v} for l, v in enumerate(last)
    ]
    rows += [
        {"layer": l, "head": h, "metric": "sink_alpha", "value": float(alpha[l, h])}
        for l in range(alpha.shape[0])
        for h in range(alpha.shape[1])
    ]
    layers = pd.DataFrame(rows, columns=["layer", "head", "metric", "value"])
    return scalars, layers.astype({"layer": "int64", "head": "Int64", "value": "float64"})
