"""Collect a sweep's run folders into tidy tables. Reads local files only: W&B is a mirror.

    python -m evictlab.aggregate outputs/runs/default [more sweep dirs] [--out DIR]

Writes into the (first) sweep dir, or --out:
  results.parquet  one row per run x scalar metric, the run's config flattened into columns
  streams.parquet  one row per run x stream: mean NLL (and KL) of that stream (for bootstrap CIs)
  curves.parquet   one row per run x position bucket (log-spaced): mean NLL / KL / attention lost
  attention.parquet  full-cache runs: mean attention by layer x key position (where the model attends)
  recall.parquet   eval.task=recall runs: one row per run x pass-key stream (depth, exact matches)
  failures.csv     every run whose metrics.json is missing or says failed, with its error, and every
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

from evictlab.run import RUN_FORMAT
from evictlab.store import read_json, write_atomic

ID_COLUMNS = [
    "run_key", "group", "strategy", "strategy_label", "non_causal", "budget", "budget_name",
    "budget_fraction", "position_mode", "allocation", "seed", "variant", "checkpoint", "model", "dataset",
    "path", "stream_len", "n_streams",
]  # fmt: skip


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
        if (s / "config.yaml").exists():  # a single run dir
            dirs.append(s)
        else:
            dirs += sorted(p.parent for p in s.rglob("config.yaml") if (p.parent / "run_info.json").exists())
    return dirs


def position_buckets(n: int, num: int = 40) -> np.ndarray:
    """Log-spaced bucket edges over positions 1..n (at most `num` buckets, every position at the start)."""
    return np.unique(np.round(np.geomspace(1, n + 1, num=num)).astype(int))


def load_run(d: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None, pd.DataFrame | None]:
    """(metrics, flattened config, per-token frame) of one run; metrics None when missing."""
    cfg = flatten(yaml.safe_load((d / "config.yaml").read_text()) or {}, "cfg.")
    try:
        metrics = read_json(d / "metrics.json")
    except (OSError, ValueError):
        return None, cfg, None
    per_token = None
    if metrics.get("status") == "ok" and (d / "per_token.parquet").exists():
        per_token = pd.read_parquet(d / "per_token.parquet")
    return metrics, cfg, per_token


def aggregate(sweeps: list[Path], out: Path | None = None) -> dict[str, pd.DataFrame]:
    """Build the tables (and write them when `out` is given)."""
    rows, stream_rows, curve_rows, attn_frames, recall_frames, failures = [], [], [], [], [], []
    for d in run_dirs(sweeps):
        metrics, cfg, pt = load_run(d)
        stale = (
            metrics is not None and metrics.get("status") == "ok" and metrics.get("run_format") != RUN_FORMAT
        )
        if metrics is None or metrics.get("status") != "ok" or pt is None or stale:
            failures.append({
                "run_dir": str(d),
                "status": "missing" if metrics is None else "stale" if stale else metrics.get("status"),
                "error": None if metrics is None else metrics.get("error"),
                "strategy": cfg.get("cfg.strategy.name"), "budget_name": cfg.get("cfg.budget.name"),
                "seed": cfg.get("cfg.seed"),
            })  # fmt: skip
            continue
        ids = {k: metrics.get(k) for k in ID_COLUMNS} | cfg | {"run_dir": str(d)}
        for name, value in metrics.items():
            if isinstance(value, bool) or name in ID_COLUMNS:
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                rows.append(ids | {"metric": name, "value": float(value)})
            elif isinstance(value, list) and value and all(isinstance(x, int | float) for x in value):
                rows += [ids | {"metric": f"{name}[{i}]", "value": float(x)} for i, x in enumerate(value)]
        base = {k: ids[k] for k in ID_COLUMNS}
        by_stream = pt.groupby("stream")
        cols = [c for c in ("nll", "nll_full", "correct", "kl", "agree", "lost_mean") if c in pt]
        s = by_stream[cols].mean().reset_index()
        stream_rows += [base | r for r in s.to_dict("records")]
        edges = position_buckets(int(pt["position"].max()))
        pt = pt.assign(bucket=np.searchsorted(edges, pt["position"].to_numpy(), side="right") - 1)
        c = pt.groupby("bucket")[cols].mean().reset_index()
        c["position"] = [float(np.sqrt(edges[b] * edges[min(b + 1, len(edges) - 1)])) for b in c["bucket"]]
        c["position_start"] = edges[c["bucket"]]
        curve_rows += [base | r for r in c.to_dict("records")]
        if (d / "recall.parquet").exists():
            recall_frames.append(pd.read_parquet(d / "recall.parquet").assign(**base))
        if metrics.get("strategy") == "full" and (d / "attention.parquet").exists():
            attn_frames.append(pd.read_parquet(d / "attention.parquet").assign(**base))
    tables = {
        "results": pd.DataFrame(rows),
        "streams": pd.DataFrame(stream_rows),
        "curves": pd.DataFrame(curve_rows),
        "attention": pd.concat(attn_frames, ignore_index=True) if attn_frames else pd.DataFrame(),
        "recall": pd.concat(recall_frames, ignore_index=True) if recall_frames else pd.DataFrame(),
        "failures": pd.DataFrame(
            failures, columns=["run_dir", "status", "error", "strategy", "budget_name", "seed"]
        ),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("results", "streams", "curves", "attention", "recall"):
            write_atomic(out / f"{name}.parquet", lambda p, t=tables[name]: t.to_parquet(p, index=False))
        write_atomic(out / "failures.csv", lambda p: tables["failures"].to_csv(p, index=False))
    return tables


def wide(results: pd.DataFrame) -> pd.DataFrame:
    """One row per run, one column per metric (the shape figures want)."""
    if results.empty:
        return results
    idx = [c for c in ID_COLUMNS if c in results]
    w = results.groupby([*idx, "metric"], dropna=False, sort=False)["value"].first().unstack("metric")
    return w.reset_index().rename_axis(columns=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "sweeps", nargs="+", type=Path, help="sweep folders (outputs/runs/<group>) or run folders"
    )
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the first sweep folder)")
    args = ap.parse_args(argv)
    missing = [s for s in args.sweeps if not s.is_dir()]
    if missing:
        print(f"error: no such sweep folder: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    out = args.out or args.sweeps[0]
    t = aggregate(args.sweeps, out)
    n_runs = t["results"]["run_key"].nunique() if not t["results"].empty else 0
    print(f"{n_runs} ok run(s), {len(t['failures'])} failed or unfinished -> {out}/results.parquet")
    if len(t["failures"]):
        print(t["failures"][["status", "strategy", "budget_name", "seed", "error"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
