"""The results format, in one place: what a run folder holds, what aggregation builds, and the column
names both sides agree on. Run, aggregate, figures, report and paper import this module; it imports
only numpy and pandas, so the analysis stage never loads torch or hydra. docs/results.md describes it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd

RUN_FORMAT = 5  # the layout of a run folder
# 5: one name per quantity: the full cache's attention on positions 0-3 is `first4_mass` (was `sink_mass`)
# 4: metrics name the weights they measured (weights_sha256)
# 3: per-layer / per-head values in layers.parquet (not `name[i]` metrics); policy facts as identity columns
# the formats aggregation reads: the same files with the same meaning once `current_names` has renamed
# them (3 lacks weights_sha256 only); an older one is listed as stale
SAME_MEANING = (3, 4, 5)
# a finished run of these formats is done (not redone: 4's files differ from 5's in names only); an older
# one is redone in place
DONE_FORMATS = (4, 5)
# names that changed, old -> current (docs/results.md "Renamed"): per-token columns (with their _mean and
# _l{i} forms), layers metrics and scalar metrics
RENAMED = {"sink_mass": "first4_mass"}
# config keys that changed, old -> current, as flattened `cfg.*` columns (exact names: `recent` is not a
# prefix of h2o's `recent_fraction`); a config key's rename changes the run keys of the runs that use it
RENAMED_KEYS = {"cfg.strategy.params.recent": "cfg.strategy.params.n_recent"}  # scissorhands
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
TASKS = "tasks.parquet"  # eval.task=<a data/tasks task>: one row per task stream (the answer written, graded)

REQUIRED = (CONFIG, PER_TOKEN, LAYERS)  # a finished run has these; the others when its settings ask


def unreadable(run: Path) -> str | None:
    """Why a finished run's result files cannot be used (a file missing, or one that does not parse), or
    None when they are sound. A run for which this is not None is redone, and aggregation lists it."""
    import pyarrow.parquet as pq
    import yaml

    for name in REQUIRED:
        if not (run / name).is_file():
            return f"{name} is missing"
    optional = [n for n in (ATTENTION, RECALL, GENERATIONS, TASKS) if (run / n).exists()]
    for name in (n for n in (*REQUIRED, *optional) if n.endswith(".parquet")):
        try:
            pq.read_metadata(run / name)
        except Exception as e:  # noqa: BLE001 - any parse failure means the file is damaged
            return f"{name} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    try:
        if not isinstance(yaml.safe_load((run / CONFIG).read_text()), dict):
            return f"{CONFIG} is not a mapping"
    except (OSError, ValueError, yaml.YAMLError) as e:
        return f"{CONFIG} is unreadable ({type(e).__name__})"
    return None


# ---- tables of an aggregated sweep (written into the sweep folder; committed as experiments/*/snapshot/)
TABLES = ("results", "streams", "curves", "attention", "layers", "recall", "tasks", "generations")
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
    "ablation",
    "non_causal",
    "budget",
    "budget_name",
    "budget_fraction",
    "position_mode",
    "allocation",
    "seed",
    "variant",
    "checkpoint",
    "weights_sha256",  # sha256 of the checkpoint's model.safetensors: which weights the numbers are of
    "streams_sha256",  # sha256 of the evaluated token streams: which text they are of (store.tokens_sha256)
    "model",
    "dataset",
    "path",
    "stream_len",
    "n_streams",
]
STREAM_COLUMNS = ("nll", "nll_full", "correct", "kl", "agree", "lost_mean")  # per-stream means


def table_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.parquet"


def current_names(frame: pd.DataFrame) -> pd.DataFrame:
    """A table or run file of any format in SAME_MEANING under the current names (`RENAMED`, `RENAMED_KEYS`):
    columns (`sink_mass_mean` -> `first4_mass_mean`) and the values of a `metric` column. Where the old and
    the current name are both columns (one policy's parameter under its old name, another's under the
    current one), they become one."""

    def new(name: str) -> str:
        for old, cur in RENAMED.items():
            if name == old or name.startswith(old + "_"):
                return cur + name[len(old) :]
        return name

    for old, cur in RENAMED_KEYS.items():
        if old in frame:
            merged = frame[cur].combine_first(frame[old]) if cur in frame else frame[old]
            frame = frame.drop(columns=[old]).assign(**{cur: merged})
    frame = frame.rename(columns={c: new(c) for c in frame.columns if isinstance(c, str) and new(c) != c})
    if "metric" in frame:  # the same rule for a metric's name as for a column's
        renamed = {m: new(m) for m in frame["metric"].dropna().unique() if new(m) != m}
        if renamed:
            frame = frame.assign(metric=frame["metric"].replace(renamed))
    return frame


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """The aggregated tables of a sweep folder or snapshot (an empty frame for each one that is absent),
    under the current names."""
    return {
        t: current_names(pd.read_parquet(table_path(folder, t)))
        if table_path(folder, t).exists()
        else pd.DataFrame()
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


def write_per_token(path: Path, per_token: dict[str, np.ndarray], rows_per_group: int = 1 << 18) -> None:
    """per_token.parquet, written in row groups of about `rows_per_group` rows: a long stream never has
    a second full copy in memory as one table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    N, n = per_token["nll"].shape
    step = max(1, rows_per_group // N)  # positions per group, all streams
    writer = None
    try:
        for p0 in range(0, n, step):
            part = {k: v[:, p0 : p0 + step] for k, v in per_token.items()}
            frame = per_token_frame(part)
            frame["position"] += p0
            table = pa.Table.from_pandas(frame, preserve_index=False)
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def nll_curve(per_token: dict[str, np.ndarray], max_rows: int = 2000) -> pd.DataFrame:
    """Mean NLL (and full-cache NLL) by predicted position over streams; past max_rows positions, by
    log-spaced position bucket (position = the bucket's geometric centre), so a 1M-token run logs a
    table of at most max_rows rows."""
    with np.errstate(all="ignore"), warnings.catch_warnings():  # all-NaN past the reference's cap
        warnings.simplefilter("ignore", RuntimeWarning)
        cols = {k: np.nanmean(per_token[k], axis=0) for k in ("nll", "nll_full") if k in per_token}
    n = len(cols["nll"])
    frame = pd.DataFrame({"position": np.arange(1, n + 1), **cols})
    if n <= max_rows:
        return frame
    edges = position_buckets(n, num=max_rows)
    bucket = np.searchsorted(edges, frame["position"].to_numpy(), side="right") - 1
    out = frame.groupby(bucket).mean()
    out["position"] = [float(np.sqrt(edges[b] * edges[min(b + 1, len(edges) - 1)])) for b in out.index]
    return out.reset_index(drop=True)


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
