"""Paper figures from committed snapshots, and the command that refreshes the snapshots.

    python -m evictlab.paper figures   # make figures: every experiments/<name>/ figure, from its snapshot
    python -m evictlab.paper run       # make paper: re-run each experiment's sweep, refresh, redraw

Each `experiments/<name>/` holds `figures.yaml` (which Hydra experiment produces it and which figures
to draw, with their arguments), a README, and `snapshot/` (the aggregated tables of that sweep:
results, streams, curves, attention parquet files).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import yaml

from evictlab.analysis import figures as F
from evictlab.analysis.aggregate import wide
from evictlab.store import REPO_ROOT, outputs_dir

EXPERIMENTS = REPO_ROOT / "experiments"
TABLES = ("results", "streams", "curves", "attention", "recall")

# figure name -> (function, the table it reads: streams | curves | runs | attention)
FIGURES = {
    "ppl_vs_budget": (F.ppl_vs_budget, "streams"),
    "kl_vs_budget": (F.kl_vs_budget, "streams"),
    "agreement_vs_budget": (F.agreement_vs_budget, "streams"),
    "nll_vs_position": (F.nll_vs_position, "curves"),
    "quality_vs_memory": (F.quality_vs_memory, "runs"),
    "throughput": (F.throughput, "runs"),
    "sink_mass": (F.sink_mass, "runs"),
    "attention_heatmap": (F.attention_heatmap, "attention"),
    "position_modes": (F.position_modes, "streams"),
    "recall_heatmaps": (F.recall_heatmaps, "recall"),
    "sink_by_variant": (F.sink_by_variant, "runs"),
    "eviction_by_variant": (F.eviction_by_variant, "streams"),
    "sink_trend": (F.sink_trend, "runs"),
}


def load_spec(folder: Path) -> dict:
    spec = yaml.safe_load((folder / "figures.yaml").read_text()) or {}
    unknown = [f["name"] for f in spec.get("figures", []) if f["name"] not in FIGURES]
    if unknown:
        raise ValueError(f"{folder / 'figures.yaml'}: unknown figure(s) {unknown}; known: {sorted(FIGURES)}")
    return spec


def load_snapshot(folder: Path) -> dict[str, pd.DataFrame]:
    snap = folder / "snapshot"
    tables = {t: pd.read_parquet(snap / f"{t}.parquet") for t in TABLES if (snap / f"{t}.parquet").exists()}
    tables |= {t: pd.DataFrame() for t in TABLES if t not in tables}
    tables["runs"] = wide(tables["results"])
    return tables


def draw(folder: Path, out: Path) -> list[Path]:
    """Draw one experiment folder's figures from its snapshot; returns the files written."""
    spec, tables = load_spec(folder), load_snapshot(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fig_spec in spec.get("figures", []):
        fn, table = FIGURES[fig_spec["name"]]
        fig = fn(tables[table], **fig_spec.get("args", {}))
        stem = fig_spec.get("file", fig_spec["name"])
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{stem}.{ext}", dpi=150)
            written.append(out / f"{stem}.{ext}")
        plt.close(fig)
    return written


def experiment_folders() -> list[Path]:
    return sorted(p.parent for p in EXPERIMENTS.glob("*/figures.yaml"))


def refresh(folder: Path, launcher: str) -> None:
    """Re-run the folder's Hydra experiment (make sweep) and copy its aggregated tables into snapshot/."""
    exp = load_spec(folder)["experiment"]
    subprocess.run(["make", "sweep", f"EXP={exp}", f"LAUNCHER={launcher}"], cwd=REPO_ROOT, check=True)
    sweep = outputs_dir() / "runs" / exp
    (folder / "snapshot").mkdir(exist_ok=True)
    for t in TABLES:
        if (sweep / f"{t}.parquet").exists():
            shutil.copyfile(sweep / f"{t}.parquet", folder / "snapshot" / f"{t}.parquet")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["figures", "run"])
    ap.add_argument("--only", nargs="*", default=None, help="experiment folder names (default: all)")
    ap.add_argument("--launcher", default="local", help="for `run`: local | submitit_local | slurm")
    ap.add_argument("--out", type=Path, default=None, help="figure root (default outputs/figures/paper)")
    args = ap.parse_args(argv)
    folders = [f for f in experiment_folders() if args.only is None or f.name in args.only]
    if not folders:
        print(f"error: no experiments/<name>/figures.yaml matches {args.only}", file=sys.stderr)
        return 2
    root = args.out or outputs_dir() / "figures" / "paper"
    for folder in folders:
        if args.command == "run":
            refresh(folder, args.launcher)
        files = draw(folder, root / folder.name)
        print(f"{folder.name}: {len(files) // 2} figure(s) -> {root / folder.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
