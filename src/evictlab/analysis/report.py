"""Draw every figure a sweep supports and write a self-contained HTML report.

python -m evictlab.figures outputs/runs/default [--out outputs/figures/default] [--report PATH]
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from evictlab.analysis import figures as F
from evictlab.analysis.aggregate import aggregate, wide
from evictlab.store import git_info, outputs_dir, write_atomic


def build_figures(tables: dict[str, pd.DataFrame]) -> dict[str, Figure]:
    """Every figure the tables support, by file stem."""
    streams, curves, runs = tables["streams"], tables["curves"], wide(tables["results"])
    figs: dict[str, Figure] = {}
    if streams.empty:
        return figs
    if "variant" in streams and streams["variant"].nunique() > 1:  # a sweep over training variants
        if "first_position_mass_per_head[0]" in runs and (runs["strategy"] == "full").any():
            figs["sink_by_variant"] = F.sink_by_variant(runs)
        if "nll_full" in streams and (streams["strategy"] != "full").any():
            figs["eviction_by_variant"] = F.eviction_by_variant(streams)
        if "sink_by_variant" in figs and (axes := trend_axes(tables["results"])):
            figs["sink_trend"] = F.sink_trend(runs, axes)
        first = F._variants(streams["variant"])[0]  # the per-policy figures show one model: the base
        tables = {k: t[t["variant"] == first] if "variant" in t else t for k, t in tables.items()}
        streams, curves, runs = tables["streams"], tables["curves"], runs[runs["variant"] == first]
    modes = set(streams["position_mode"])
    mode = "original" if "original" in modes else sorted(modes)[0]
    figs["ppl_vs_budget"] = F.ppl_vs_budget(streams, mode)
    if "kl" in streams:
        figs["kl_vs_budget"] = F.kl_vs_budget(streams, mode)
        figs["agreement_vs_budget"] = F.agreement_vs_budget(streams, mode)
    budgets = sorted(set(streams.loc[streams["strategy"] != "full", "budget"]))
    if budgets:
        figs["nll_vs_position"] = F.nll_vs_position(curves, budgets[len(budgets) // 2], mode)
    figs["quality_vs_memory"] = F.quality_vs_memory(runs, mode)
    figs["throughput"] = F.throughput(runs)
    if any(c.startswith("sink_mass_per_layer[") for c in runs):
        figs["sink_mass"] = F.sink_mass(runs)
    if not tables.get("recall", pd.DataFrame()).empty:
        figs["recall_heatmaps"] = F.recall_heatmaps(tables["recall"], mode=mode)
    if not tables.get("attention", pd.DataFrame()).empty:
        figs["attention_heatmap"] = F.attention_heatmap(tables["attention"])
    if {"original", "cache"} <= modes:
        figs["position_modes"] = F.position_modes(streams)
    return figs


def headline_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per policy x budget x mode: perplexity with 95% CI, KL, agreement, KV KiB."""
    streams, runs = tables["streams"], wide(tables["results"])
    keys = ["strategy", "budget", "position_mode"]
    if "variant" in streams and streams["variant"].nunique() > 1:
        keys = ["variant", *keys]
    ppl = F.summarize_streams(streams, "nll", np.exp, keys)
    ppl["perplexity [95% CI]"] = [
        f"{p:.3f} [{lo:.3f}, {hi:.3f}]" for p, lo, hi in ppl[["point", "low", "high"]].values
    ]
    extra = runs.groupby(keys, as_index=False)[
        [c for c in ("kl_mean", "agreement", "kv_bytes") if c in runs]
    ].mean()
    t = ppl[[*keys, "perplexity [95% CI]", "n"]].merge(extra, on=keys, how="left")
    t["kv_KiB"] = t.pop("kv_bytes") / 1024
    t["order"] = t["strategy"].map({n: i for i, n in enumerate(F.POLICY_ORDER)}).fillna(99)
    t = t.sort_values([*keys[:-3], "position_mode", "order", "budget"]).drop(columns="order")
    t["strategy"] = t["strategy"].map(F.label)
    return t.rename(columns={"n": "units (seed x stream)"})


def trend_axes(results: pd.DataFrame, min_points: int = 3) -> dict[str, dict[str, float]]:
    """Scale knobs a variant sweep covers, for `figures.sink_trend`: every numeric model/train setting in
    which at least min_points - 1 variants differ from `base` and in nothing else, as
    {"train.steps": {"base": 400, "steps200": 200, ...}}."""
    cols = [c for c in results if c.startswith(("cfg.model.", "cfg.train.", "cfg.dataset."))]
    if "variant" not in results or not cols:
        return {}
    per = results.groupby("variant")[cols].first()
    if "base" not in per.index:
        return {}
    base = per.loc["base"]

    def same(a, b) -> bool:
        return (pd.isna(a) and pd.isna(b)) if pd.api.types.is_scalar(a) and pd.isna(a) else a == b

    def number(x) -> bool:
        return pd.api.types.is_number(x) and not pd.api.types.is_bool(x)

    axes: dict[str, dict[str, float]] = {}
    for variant, row in per.drop(index="base").iterrows():
        diff = [c for c in cols if not same(row[c], base[c])]
        if len(diff) != 1 or not (number(row[diff[0]]) and number(base[diff[0]])):
            continue
        axis = axes.setdefault(diff[0].removeprefix("cfg."), {"base": float(base[diff[0]])})
        axis[variant] = float(row[diff[0]])
    return {k: v for k, v in axes.items() if len(v) >= min_points}


def variant_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per training variant: the model's validation bits per byte, its attention on the first token (the
    strongest head, and the mean over heads and layers), full-cache perplexity, each eviction arm's
    perplexity relative to the full cache, and window minus StreamingLLM NLL per stream (paired, original
    positions), with 95% bootstrap CIs over (seed, stream) units."""
    runs, streams = wide(tables["results"]), tables["streams"]
    mass = F._first_token_mass(runs)
    ratios = F.eviction_ratios(streams).set_index(["variant", "strategy", "position_mode"])

    rows = []
    for v in F._variants(mass):
        full = runs[
            (runs["variant"] == v) & (runs["strategy"] == "full") & (runs["position_mode"] == "original")
        ]
        strongest = mass[v].max(axis=1)
        row = {"variant": v, "val bits/byte": full["checkpoint_val_bpb"].iloc[0],
               "strongest head on pos 0 [%]": f"{100 * strongest.max():.1f} (L{int(strongest.argmax())})",
               "mean on pos 0 [%]": 100 * mass[v].mean(), "full-cache ppl": full["ppl"].mean()}  # fmt: skip
        for name, mode in F.EVICTION_ARMS:
            a = ratios.loc[(v, name, mode)] if (v, name, mode) in ratios.index else None
            row[f"{F.label(name)} ({mode}) / full"] = (
                "-" if a is None else f"{a['point']:.3f} [{a['low']:.3f}, {a['high']:.3f}]"
            )
        original = streams[(streams["variant"] == v) & (streams["position_mode"] == "original")]
        nll = {n: original[original["strategy"] == n].set_index(["seed", "stream"])["nll"]
               for n in ("window", "streaming_llm")}  # fmt: skip
        paired = (nll["window"] - nll["streaming_llm"]).dropna().to_numpy()
        row["window - StreamingLLM NLL"] = (
            "-" if not len(paired) else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*F.bootstrap_ci(paired))
        )
        rows.append(row)
    return pd.DataFrame(rows)


def _png_b64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return base64.b64encode(buf.getvalue()).decode()


def write_report(path: Path, tables: dict[str, pd.DataFrame], figs: dict[str, Figure], title: str) -> None:
    g = git_info()
    failures = tables["failures"]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
        "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M')} from commit <code>{g['commit']}</code>"
        f"{' (dirty)' if g['dirty'] else ''}. Runs: {tables['results']['run_key'].nunique()} ok, "
        f"{len(failures)} failed or unfinished.</p>",
    ]
    if len(failures):
        parts.append("<h2>Failed or unfinished runs</h2>" + failures.to_html(index=False))
    parts.append(
        "<h2>Headline numbers</h2>" + headline_table(tables).to_html(index=False, float_format="%.4g")
    )
    if "variant" in tables["streams"] and tables["streams"]["variant"].nunique() > 1:
        parts.append(
            "<h2>Training variants</h2>" + variant_table(tables).to_html(index=False, float_format="%.3f")
        )
    for name, fig in figs.items():
        img = f"<img alt='{name}' src='data:image/png;base64,{_png_b64(fig)}'>"
        parts.append(f"<h2 id='{name}'>{name.replace('_', ' ')}</h2>{img}")
    cfg_cols = sorted(c for c in tables["results"] if c.startswith("cfg."))
    if cfg_cols:
        shared = tables["results"][cfg_cols].astype(str).nunique() == 1
        common = tables["results"].iloc[0][[c for c in cfg_cols if shared[c]]]
        parts.append("<h2>Configuration shared by every run</h2>" + common.to_frame("value").to_html())
    parts.append("</body></html>")
    text = "\n".join(parts)
    write_atomic(path, lambda p: p.write_text(text))


def _log_to_wandb(tables: dict[str, pd.DataFrame], out: Path, figs: dict[str, Figure], group: str) -> None:
    """Mirror the figures and the headline table to W&B with the sweep's own logger settings."""
    from evictlab.config import LoggerConfig, LoggerMode
    from evictlab.tracking import log_report

    res = tables["results"]
    mode = res["cfg.logger.mode"].iloc[0] if "cfg.logger.mode" in res else "disabled"
    project = res["cfg.logger.project"].iloc[0] if "cfg.logger.project" in res else None
    outputs = Path(res["cfg.paths.outputs"].iloc[0]) if "cfg.paths.outputs" in res else outputs_dir()
    logger = LoggerConfig(mode=LoggerMode(mode), project=project if isinstance(project, str) else None)
    log_report(logger, outputs, group, {stem: out / f"{stem}.png" for stem in figs}, headline_table(tables))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", type=Path, help="sweep folders (outputs/runs/<group>)")
    ap.add_argument("--out", type=Path, default=None, help="figure folder (default outputs/figures/<name>)")
    ap.add_argument(
        "--report", type=Path, default=None, help="HTML report (default outputs/report/index.html)"
    )
    ap.add_argument("--no-wandb", action="store_true", help="do not log the figures and table to W&B")
    args = ap.parse_args(argv)
    missing = [s for s in args.sweeps if not s.is_dir()]
    if missing:
        print(f"error: no such sweep folder: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    name = args.sweeps[0].name
    tables = aggregate(args.sweeps, args.sweeps[0])
    if tables["results"].empty:
        print(f"error: no finished runs under {', '.join(map(str, args.sweeps))}", file=sys.stderr)
        return 2
    out = args.out or outputs_dir() / "figures" / name
    out.mkdir(parents=True, exist_ok=True)
    figs = build_figures(tables)
    for stem, fig in figs.items():
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{stem}.{ext}", dpi=150)
    report = args.report or outputs_dir() / "report" / "index.html"
    write_report(report, tables, figs, f"evictlab: {name}")
    if not args.no_wandb:
        _log_to_wandb(tables, out, figs, name)
    for fig in figs.values():
        plt.close(fig)
    print(f"{len(figs)} figures -> {out}; report -> {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
