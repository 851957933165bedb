"""Collect a sweep's run folders into tidy tables. Reads local files only: W&B is a mirror.

    python -m evictlab.aggregate outputs/runs/default [more sweep dirs] [--out DIR]

Writes into the (first) sweep dir, or --out (names and columns: evictlab/results.py, docs/results.md):
  results.parquet    one row per run x scalar metric, the run's config flattened into cfg.* columns
  streams.parquet    one row per run x stream: mean NLL (and KL, ...) of that stream (for bootstrap CIs)
  curves.parquet     one row per run x stream x position bucket (log-spaced): mean NLL / KL / attention lost
  layers.parquet     one row per run x layer (x head) x metric: budgets, attention lost, sink mass, ...
  attention.parquet  full-cache runs: mean attention by layer x key position (where the model attends)
  recall.parquet     eval.task=recall runs: one row per run x pass-key stream (depth, exact matches)
  tasks.parquet      data/tasks runs (eval.task=niah_multikey ...): one row per run x task stream, graded
  failures.csv       every run whose metrics.json is missing or says failed, with its error, and every
                     stale run (written by an older run format: its numbers may mean something else)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from evictlab import results as R
from evictlab.errors import ConfigError
from evictlab.store import read_json, write_atomic


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        elif isinstance(v, list):
            out[key] = str(v)
        else:
            out[key] = v
    return out


def run_dirs(sweeps: list[Path]) -> list[Path]:
    dirs = []
    for s in sweeps:
        if (s / R.CONFIG).exists():  # a single run dir
            dirs.append(s)
        else:
            dirs += sorted(p.parent for p in s.rglob(R.CONFIG) if (p.parent / R.RUN_INFO).exists())
    return dirs


def load_run(d: Path) -> tuple[dict[str, Any] | None, dict[str, Any], pd.DataFrame | None]:
    """(metrics, flattened config, per-token frame) of one run; metrics None when missing, the frame None
    unless the run is a sound finished run of a format that means what the current one does
    (`failure_row` says why not)."""
    cfg = flatten(yaml.safe_load((d / R.CONFIG).read_text()) or {}, "cfg.") | provenance(d)
    try:
        metrics = read_json(d / R.METRICS)
    except (OSError, ValueError):
        return None, cfg, None
    per_token = None
    if (
        metrics.get("status") == "ok"
        and metrics.get("run_format") in R.SAME_MEANING
        and R.unreadable(d) is None
    ):
        per_token = R.current_names(pd.read_parquet(d / R.PER_TOKEN))
    return metrics, cfg, per_token


def provenance(d: Path) -> dict[str, Any]:
    """The evictlab commit a run ran at (`info.git_commit`, `info.git_dirty`) and the documents of its
    streams (`info.stream_documents`, a list; None before runs recorded it), from its run_info.json."""
    try:
        info = read_json(d / R.RUN_INFO)
        git = info.get("git") or {}
    except (OSError, ValueError, AttributeError):
        info, git = {}, {}
    return {
        "info.git_commit": git.get("commit"),
        "info.git_dirty": git.get("dirty"),
        "info.stream_documents": info.get("stream_documents"),
    }


def failure_row(d: Path, metrics: dict[str, Any] | None, cfg: dict[str, Any], per_token) -> dict | None:
    """The failures.csv row of a run that is missing, failed, unfinished, stale or unreadable; None for a
    sound run (one `load_run` read the per-token frame of)."""
    if per_token is not None:
        return None
    status = None if metrics is None else metrics.get("status")
    stale = status == "ok" and metrics.get("run_format") not in R.SAME_MEANING
    error = None if metrics is None else metrics.get("error")
    if status == "ok" and not stale:
        status, error = "unreadable", R.unreadable(d)
    return {
        "run_dir": str(d),
        "status": "missing" if metrics is None else "stale" if stale else status,
        "error": error,
        "strategy": cfg.get("cfg.strategy.name"),
        "budget_name": cfg.get("cfg.budget.name"),
        "seed": cfg.get("cfg.seed"),
    }


def metric_rows(ids: dict[str, Any], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per finite scalar metric (identity columns and booleans are columns, not metrics)."""
    return [
        ids | {"metric": name, "value": float(value)}
        for name, value in metrics.items()
        if name not in R.ID_COLUMNS
        and not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
    ]


def stream_and_curve_rows(
    base: dict[str, Any], pt: pd.DataFrame, documents: list[str] | None = None
) -> tuple[list[dict], list[dict]]:
    """Per-stream means (with the stream's `documents` where the run recorded them), and per stream x
    log-spaced position bucket means, of the per-token metrics."""
    cols = [c for c in R.STREAM_COLUMNS if c in pt]
    # the policy's NLL over the predictions the full-cache reference covers (eval.full_max_len caps it)
    paired = {"nll_paired": pt["nll"].where(pt["nll_full"].notna())} if "nll_full" in pt else {}
    s = pt.assign(**paired).groupby("stream")[[*cols, *paired]].mean().reset_index()
    if documents is not None:
        s["documents"] = [documents[i] if i < len(documents) else None for i in s["stream"]]
    edges = R.position_buckets(int(pt["position"].max()))
    if paired and pt["nll_full"].isna().any():  # no bucket straddles the reference's cap
        edges = np.union1d(edges, [int(pt.loc[pt["nll_full"].notna(), "position"].max()) + 1])
    pt = pt.assign(bucket=np.searchsorted(edges, pt["position"].to_numpy(), side="right") - 1, **paired)
    by = pt.groupby(["stream", "bucket"])
    c = by[[*cols, *paired]].mean()
    c["n"] = by["nll"].count()  # the predictions the bucket scores (all but a sampled run's), those covered
    if paired:
        c["n_paired"] = by["nll_full"].count()
    c = c.reset_index()
    c["position"] = [float(np.sqrt(edges[b] * edges[min(b + 1, len(edges) - 1)])) for b in c["bucket"]]
    c["position_start"] = edges[c["bucket"]]
    return [base | r for r in s.to_dict("records")], [base | r for r in c.to_dict("records")]


def aggregate(sweeps: list[Path], out: Path | None = None) -> dict[str, pd.DataFrame]:
    """Build the tables (and write them when `out` is given)."""
    rows: dict[str, list] = {"results": [], "streams": [], "curves": []}
    frames: dict[str, list[pd.DataFrame]] = {
        n: [] for n in ("attention", "layers", "recall", "tasks", "generations")
    }
    failures = []
    for d in run_dirs(sweeps):
        try:
            metrics, cfg, pt = load_run(d)
        except Exception as e:  # noqa: BLE001 - one bad run folder is listed, never fatal
            error = f"{type(e).__name__}: {e}"
            failures.append(
                dict.fromkeys(R.FAILURE_COLUMNS) | {"run_dir": str(d), "status": "unreadable", "error": error}
            )
            continue
        if (failure := failure_row(d, metrics, cfg, pt)) is not None:
            failures.append(failure)
            continue
        base = {k: metrics.get(k) for k in R.ID_COLUMNS}
        documents = cfg.pop("info.stream_documents")
        rows["results"] += metric_rows(base | cfg | {"run_dir": str(d)}, metrics)
        streams, curves = stream_and_curve_rows(base, pt, documents)
        rows["streams"] += streams
        rows["curves"] += curves
        for name, file in (
            ("layers", R.LAYERS),
            ("recall", R.RECALL),
            ("tasks", R.TASKS),
            ("generations", R.GENERATIONS),
            ("attention", R.ATTENTION),
        ):
            if (d / file).exists() and (name != "attention" or not metrics.get("evicts")):  # full cache only
                frames[name].append(R.current_names(pd.read_parquet(d / file)).assign(**base))
    tables = {name: pd.DataFrame(r) for name, r in rows.items()}
    tables |= {name: pd.concat(f, ignore_index=True) if f else pd.DataFrame() for name, f in frames.items()}
    tables["failures"] = pd.DataFrame(failures, columns=R.FAILURE_COLUMNS)
    check_weights(tables["results"])
    check_streams(tables["results"])
    if out is not None:
        write_tables(out, tables)
    return tables


def check_weights(results: pd.DataFrame) -> None:
    """Refuse (ConfigError, one line) a sweep where one checkpoint name stands for two sets of weights: its
    runs would be compared as if they measured one model."""
    if results.empty or "weights_sha256" not in results:
        return
    runs = results.drop_duplicates("run_dir").dropna(subset=["weights_sha256"])
    hashes = runs.groupby("checkpoint")["weights_sha256"].unique()
    for name, found in hashes.items():
        if len(found) > 1:
            shown = ", ".join(f"{h[:12]}... ({(runs['weights_sha256'] == h).sum()} runs)" for h in found)
            raise ConfigError(
                f"checkpoint {name} stands for {len(found)} sets of weights in these runs ({shown}): "
                "the checkpoint was replaced after some runs finished; rerun the sweep (runs of the old "
                "weights are redone) or remove their folders"
            )


# The settings that select a run's token streams: runs that agree on all of them must have measured the
# same text (the policy, budget and position mode do not change it).
STREAM_SETTINGS = ("checkpoint", "dataset", "seed", "stream_len", "n_streams")
STREAM_CONFIG_PREFIXES = (
    "cfg.dataset.",
    "cfg.tokenizer.",
    "cfg.eval.stream",
    "cfg.eval.split",
    "cfg.eval.task",
    "cfg.eval.recall",
    "cfg.eval.n_streams",
    "cfg.model.sink_token",
)


def check_streams(results: pd.DataFrame) -> None:
    """Refuse (ConfigError, one line) a sweep whose runs of the same stream settings measured different
    text (`streams_sha256`): the corpus changed between them (the installed manual pages, an edited
    text_files folder), so their policies would be compared on different documents. Runs from before the
    hash was recorded are not checked."""
    if results.empty or "streams_sha256" not in results:
        return
    runs = results.drop_duplicates("run_dir").dropna(subset=["streams_sha256"])
    if runs.empty:
        return
    keys = [c for c in STREAM_SETTINGS if c in runs] + sorted(
        c for c in runs.columns if c.startswith(STREAM_CONFIG_PREFIXES)
    )
    setting = [repr(tuple(str(v) for v in row)) for row in runs[keys].itertuples(index=False)]
    for _, g in runs.groupby(setting):
        found = g["streams_sha256"].unique()
        if len(found) > 1:
            shown = "; ".join(
                f"{h[:12]}...: "
                + ", ".join(sorted(Path(d).name for d in g.loc[g["streams_sha256"] == h, "run_dir"]))
                for h in found
            )
            raise ConfigError(
                f"runs of the same stream settings measured {len(found)} different texts ({shown}): the "
                "corpus changed between them (for dataset=man_pages: packages installed or removed); "
                "remove the folders of the runs on the text you do not want and rerun the sweep"
            )


def _weights(row: pd.Series) -> str:
    sha = row.get("weights_sha256")
    return f", weights sha256 {sha[:12]}..." if isinstance(sha, str) and sha else ""


def commit_lines(results: pd.DataFrame) -> list[str]:
    """The evictlab commit(s) the runs ran at, each with its run count (dirty: with uncommitted changes)."""
    if "info.git_commit" not in results or results.empty:
        return []
    runs = results.drop_duplicates("run_dir" if "run_dir" in results else "run_key")
    dirty = runs["info.git_dirty"].fillna(False).astype(bool) if "info.git_dirty" in runs else False
    label = runs["info.git_commit"].fillna("unknown").astype(str).str[:12] + np.where(dirty, " (dirty)", "")
    counts = label.value_counts()
    return [f"evictlab commit {c}: {n} run(s)" for c, n in counts.items()]


def subjects(results: pd.DataFrame) -> pd.DataFrame:
    """The models and datasets a sweep holds: one row per (model, checkpoint, weights, dataset) with its
    run count."""
    cols = [c for c in ("model", "checkpoint", "weights_sha256", "dataset") if c in results]
    if results.empty or not cols:
        return pd.DataFrame(columns=[*cols, "runs"])
    runs = results.drop_duplicates("run_dir" if "run_dir" in results else "run_key")
    return runs.groupby(cols, dropna=False).size().rename("runs").reset_index()


def subject_lines(results: pd.DataFrame) -> list[str]:
    """What a sweep measured, in words (model(s) and dataset(s)), with a warning line when it mixes them."""
    s = subjects(results)
    if s.empty:
        return []
    lines = [
        f"{r['model']} ({r['checkpoint']}{_weights(r)}) on {r['dataset']}: {r['runs']} run(s)"
        for _, r in s.iterrows()
    ]
    lines += commit_lines(results)
    for col in ("model", "dataset"):
        if col in s and s[col].nunique() > 1:
            names = ", ".join(map(str, s[col].unique()))
            lines.append(
                f"warning: this sweep mixes {col}s ({names}): compare its runs within one {col} only"
            )
    return lines


def write_tables(out: Path, tables: dict[str, pd.DataFrame]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in R.TABLES:
        write_atomic(R.table_path(out, name), lambda p, t=tables[name]: t.to_parquet(p, index=False))
    write_atomic(out / R.FAILURES, lambda p: tables["failures"].to_csv(p, index=False))


def wide(results: pd.DataFrame) -> pd.DataFrame:
    """One row per run, one column per metric (the shape figures want)."""
    if results.empty:
        return results
    idx = [c for c in R.ID_COLUMNS if c in results]
    w = results.groupby([*idx, "metric"], dropna=False, sort=False)["value"].first().unstack("metric")
    return w.reset_index().rename_axis(columns=None)


def check_folders(folders: list[Path]) -> bool:
    """Print one line and return False if a folder does not exist."""
    missing = [s for s in folders if not s.is_dir()]
    if missing:
        print(f"error: no such sweep folder: {', '.join(map(str, missing))}", file=sys.stderr)
    return not missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "sweeps", nargs="+", type=Path, help="sweep folders (outputs/runs/<group>) or run folders"
    )
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the first sweep folder)")
    args = ap.parse_args(argv)
    if not check_folders(args.sweeps):
        return 2
    out = args.out or args.sweeps[0]
    try:
        t = aggregate(args.sweeps, out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_runs = t["results"]["run_key"].nunique() if not t["results"].empty else 0
    print(f"{n_runs} ok run(s), {len(t['failures'])} failed or unfinished -> {out}/results.parquet")
    for line in subject_lines(t["results"]):
        print(line)
    if len(t["failures"]):
        print(t["failures"][["status", "strategy", "budget_name", "seed", "error"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
