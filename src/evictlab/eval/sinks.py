"""Attention-sink metrics of a model (a property of the model, measured the same way in every run and in
checkpoint meta).

* `sink_head_fraction`: Gu et al.'s Sink_1^0.3 ("When Attention Sink Emerges in Language Models", ICLR
  2025): alpha_h = the attention on position 0, averaged over every query of sequences of 64 tokens of
  held-out text; a (layer, head) is a sink head when alpha_h > 0.3; the metric is the share of sink heads.
* `sink_head_fraction_deep`: the same over layers >= 1 (Gu and StreamingLLM find no sinks in layer 0).
* `sink_head_fraction_eps10`, `_eps20`, `_eps30`: the share at epsilon 0.1, 0.2 and 0.3 (Gu et al. report
  the metric's dependence on the threshold; a 0.3 cut alone hides heads just below it).
* the per-query distribution behind alpha_h (a mean can hide a head that gives position 0 everything for
  a few queries and nothing for the rest): per (layer, head) the 10th, 50th and 90th percentile over the
  queries (`sink_alpha_p10/_p50/_p90`), and `sink_query_share_eps10/20/30`, the share of (layer, head,
  query) triples above each threshold. Query 0 is left out of the distribution (it can only attend to
  itself); alpha_h keeps it, as Gu et al. define it.
* per layer: the attention the last query puts on position 0 at the training context (StreamingLLM,
  App. F), mean over heads and sequences.

Streams start with the corpus prefix, so position 0 is <bos> (or <sink>). The text comes from a fixed
seed, so the numbers depend on the model only: `cached_sink_metrics` computes them once per (checkpoint,
corpus, context) and every later run reads them (a 30-layer model spends more on them than on a run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from evictlab.data.dataset import Corpus
from evictlab.data.streams import eval_streams
from evictlab.eval.full import attention_summary
from evictlab.models.gpt import GPT
from evictlab.store import file_lock, stable_hash, write_json

# part of the cached metrics' key: bump when their definition changes (2: the share at three thresholds;
# 3: the per-query distribution)
SINK_FORMAT = 3
SINK_PERCENTILES = (10, 50, 90)  # of the per-query attention on position 0, per (layer, head)

SINK_THRESHOLD = 0.3  # Gu et al.'s epsilon
SINK_THRESHOLDS = (0.1, 0.2, 0.3)  # also reported (`sink_head_fraction_eps<100 x epsilon>`)
SINK_SEQ_LEN = 64  # tokens per sequence for alpha_h (position 0 included)
SINK_SEQS = 64  # sequences for alpha_h
LAST_QUERY_SEQS = 8  # sequences at the training context for the last query's attention
PRETRAINED_CONTEXT = 1024  # a pretrained model's "training context" here (its own, if shorter)


def _first_position_attention(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """[L, B, H, n]: each query's attention on position 0 (tokens [B, n+1]), computed a chunk of queries at
    a time (no [n, n] matrix per layer is kept)."""
    return attention_summary(model, tokens[:, :-1]).first


@torch.no_grad()
def sink_metrics(model: GPT, corpus: Corpus, context: int, sink_token: bool, split: str = "test"):
    """(scalars, per-layer/per-head rows for layers.parquet) of the model's attention sink."""
    device = next(model.parameters()).device
    short = eval_streams(corpus, SINK_SEQS, SINK_SEQ_LEN + 1, sink_token, "concat", split, seed=0)
    first = _first_position_attention(model, short.to(device))  # [L, B, H, n]
    alpha = first.mean(dim=(1, 3))  # [L, H]
    per_query = first[..., 1:].transpose(1, 2).flatten(2).float()  # [L, H, B * (n-1)]: query 0 left out
    pct = torch.quantile(per_query, torch.tensor(SINK_PERCENTILES, dtype=per_query.dtype) / 100, dim=-1)
    sinks = (alpha > SINK_THRESHOLD).float()  # [L, H]
    n_long = min(LAST_QUERY_SEQS, max(1, len(corpus.splits[split].ids) // (context + 1) - 1))
    long = eval_streams(corpus, n_long, context + 1, sink_token, "concat", split, seed=0)
    last = _first_position_attention(model, long.to(device))[..., -1].mean(dim=(1, 2)).tolist()
    scalars = {
        "sink_head_fraction": float(sinks.mean()),
        "sink_head_fraction_deep": float(sinks[1:].mean()) if len(sinks) > 1 else float("nan"),
    }
    for eps in SINK_THRESHOLDS:
        scalars[f"sink_head_fraction_eps{round(100 * eps)}"] = float((alpha > eps).float().mean())
        scalars[f"sink_query_share_eps{round(100 * eps)}"] = float((per_query > eps).float().mean())
    rows = [
        {"layer": l, "head": None, "metric": "last_query_first_mass", "value": v} for l, v in enumerate(last)
    ]
    rows += [
        {"layer": l, "head": h, "metric": "sink_alpha", "value": float(alpha[l, h])}
        for l in range(alpha.shape[0])
        for h in range(alpha.shape[1])
    ]
    rows += [
        {"layer": l, "head": h, "metric": f"sink_alpha_p{q}", "value": float(pct[i, l, h])}
        for i, q in enumerate(SINK_PERCENTILES)
        for l in range(alpha.shape[0])
        for h in range(alpha.shape[1])
    ]
    layers = pd.DataFrame(rows, columns=["layer", "head", "metric", "value"])
    return scalars, layers.astype({"layer": "int64", "head": "Int64", "value": "float64"})


def cached_sink_metrics(
    root: Path, checkpoint: str, model: GPT, corpus: Corpus, context: int, sink_token: bool, split: str
):
    """`sink_metrics`, computed by the first run that asks for them and stored under root/<key>.json for
    every later one; the key holds the checkpoint (name and weights hash), the corpus's tokens, the prefix
    its streams start with (with or without <bos>: position 0 is another token), the context and the
    precision, so a retrained or re-tokenised subject is measured again."""
    weights = model.wte.weight
    key = stable_hash(
        {
            "checkpoint": checkpoint,
            "data_hash": corpus.data_hash,
            "context": context,
            "sink_token": sink_token,
            "prefix": corpus.prefix(sink_token),
            "split": split,
            "dtype": str(weights.dtype),
            "device": weights.device.type,
            "format": SINK_FORMAT,
            "shape": [SINK_THRESHOLDS, SINK_SEQ_LEN, SINK_SEQS, LAST_QUERY_SEQS, SINK_PERCENTILES],
        }
    )
    path = Path(root) / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path):
        try:
            stored = json.loads(path.read_text())
            layers = pd.DataFrame(stored["layers"], columns=["layer", "head", "metric", "value"])
            return stored["scalars"], layers.astype({"layer": "int64", "head": "Int64", "value": "float64"})
        except (OSError, ValueError, KeyError):  # absent or damaged: measured (again)
            pass
        scalars, layers = sink_metrics(model, corpus, context, sink_token, split)
        heads = [None if pd.isna(h) else int(h) for h in layers["head"]]
        rows = [
            {"layer": int(r.layer), "head": h, "metric": r.metric, "value": float(r.value)}
            for r, h in zip(layers.itertuples(), heads, strict=True)
        ]
        write_json(path, {"scalars": scalars, "layers": rows})
        return scalars, layers
