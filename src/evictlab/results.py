"""The results format, in one place: what a run folder holds, what aggregation builds, and the column
names both sides agree on. Run, aggregate, figures, report and paper import this module; it imports
only numpy and pandas, so the analysis stage never loads torch or hydra. docs/results.md describes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

RUN_FORMAT = 3  # the layout of a run folder; a finished run of an older format is redone in place
# 3: per-layer / per-head values in layers.parquet (not `name[i]` metrics); policy facts as identity columns
KEY_VERSION = 2  # hashed into run keys: bumped only when the same config would produce other numbers

# ---- files of one run folder: outputs/runs/<group>/<strategy>-<budget>-<key>/
CONFIG = "config.yaml"  # the resolved config
RUN_INFO = "run_info.json"  # provenance: git, packages, host, SLURM ids, start time
METRICS = "metrics.json"  # written last and atomically: status ok | failed, and the scalar metrics
PER_TOKEN = "per_token.parquet"  # one row per (stream, predicted position)
LAYERS = "layers.parquet"  # tidy per-layer / per-head values: layer, head (<NA> = whole layer), metric, value
ATTENTION = "attention.parquet"  # full-cache attention by layer x key position
RECALL = "recall.parquet"  # eval.task=recall: one row per pass-key stream
GENERATIONS = "generations.parquet"  # eval.generate_tokens > 0: greedy continuations, policy vs full cache

# ---- tables of an aggregated sweep (written into the sweep folder; committed as experiments/*/snapshot/)
TABLES = ("results", "streams", "curves", "attention", "layers", "recall")
FAILURES = "failures.csv"
FAILURE_COLUMNS = ["run_dir", "status", "error", "strategy", "budget_name", "seed"]

# Columns that identify a run in every table (the policy's facts come from its class: Policy.facts()).
ID_COLUMNS = [
    "run_key",
    "group",
    "strategy",
    "strategy_label",
    "strategy_order",
    "evicts",
    "non_causal",
    "budget",
    "budget_name",
    "budget_fraction",
    "position_mode",
    "allocation",
    "seed",
    "variant",
    "checkpoint",
    "model",
    "dataset",
    "path",
    "stream_len",
    "n_streams",
]
STREAM_COLUMNS = ("nll", "nll_full", "correct", "kl", "agree", "lost_mean")  # per-stream means


def table_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.parquet"


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """The aggregated tables of a sweep folder or snapshot (an empty frame for each one that is absent)."""
    return {
        t: pd.read_parquet(table_path(folder, t)) if table_path(folder, t).exists() else pd.DataFrame()
        for t in TABLES
    }


def per_token_frame(per_token: dict[str, np.ndarray]) -> pd.DataFrame:
    """Long format: one row per (stream, predicted position) with every per-token metric; [N, n, L] arrays
    become a mean column and one column per layer (name_l0, name_l1, ...)."""
    N, n = per_token["nll"].shape
    cols: dict[str, np.ndarray] = {
        "stream": np.repeat(np.arange(N), n),
        "position": np.tile(np.arange(1, n + 1), N),  # position of the predicted token in the stream
    }
    for name, arr in per_token.items():
        if arr.ndim == 2:
            cols[name] = arr.reshape(-1)
        else:
            cols[f"{name}_mean"] = arr.mean(-1).reshape(-1)
            for layer in range(arr.shape[-1]):
                cols[f"{name}_l{layer}"] = arr[..., layer].reshape(-1)
    return pd.DataFrame(cols)


def attention_frame(by_key: np.ndarray) -> pd.DataFrame:
    """[L, n] mean attention by key position -> rows (layer, key_position, attention)."""
    L, n = by_key.shape
    return pd.DataFrame(
        {
            "layer": np.repeat(np.arange(L), n),
            "key_position": np.tile(np.arange(n), L),
            "attention": by_key.reshape(-1),
        }
    )


def position_buckets(n: int, num: int = 40) -> np.ndarray:
    """Log-spaced bucket edges over positions 1..n (at most `num` buckets, every position at the start)."""
    return np.unique(np.round(np.geomspace(1, n + 1, num=num)).astype(int))
