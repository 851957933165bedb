"""Figures as pure functions: tidy frames in, a matplotlib Figure out. One theme, one policy order and
colour everywhere. Confidence intervals: 95% bootstrap over (seed, stream) units.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from evictlab.analysis.aggregate import position_buckets  # noqa: E402

POLICY_ORDER = [
    "full", "window", "streaming_llm", "recompute_window", "h2o", "tova", "scissorhands", "l2norm", "random",
    "oracle",
]  # fmt: skip
_PALETTE = sns.color_palette("tab10", len(POLICY_ORDER))
COLORS = dict(zip(POLICY_ORDER, _PALETTE, strict=True))
LABELS = {
    "oracle": "oracle (non-causal)",
    "streaming_llm": "StreamingLLM",
    "recompute_window": "window+recompute",
}


def theme() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)


def ordered(names) -> list[str]:
    names = list(dict.fromkeys(names))
    known = [p for p in POLICY_ORDER if p in names]
    return known + sorted(n for n in names if n not in POLICY_ORDER)


def color(name: str):
    return COLORS.get(name, "0.3")


def label(name: str) -> str:
    return LABELS.get(name, name)


def bootstrap_ci(
    values: np.ndarray, stat=np.mean, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(point, low, high) of stat over resampled units."""
    values = np.asarray(values, dtype=float)
    point = float(stat(values))
    if len(values) < 2:
        return point, point, point
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_boot, len(values)))
    boots = np.apply_along_axis(stat, 1, values[idx])
    lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
    return point, float(min(lo, point)), float(max(hi, point))


def summarize_streams(
    streams: pd.DataFrame, column: str, transform=None, keys=("strategy", "budget", "position_mode")
) -> pd.DataFrame:
    """Per (strategy, budget, position_mode) or other keys: point estimate and 95% CI of mean(column)
    over (seed, stream) units, optionally transformed (exp for perplexity)."""
    rows = []
    keys = list(keys)
    for key, g in streams.groupby(keys, dropna=False):
        point, lo, hi = bootstrap_ci(g[column].to_numpy())
        if transform is not None:
            point, lo, hi = transform(point), transform(lo), transform(hi)
        rows.append(dict(zip(keys, key, strict=True)) | {"point": point, "low": lo, "high": hi, "n": len(g)})
    return pd.DataFrame(rows)


def _log_y(ax) -> None:
    """Log y axis with plain numbers (2.5, 3, 4) instead of 10^x labels."""
    from matplotlib.ticker import FormatStrFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _finish(fig: Figure, ax, xlabel: str, ylabel: str, title: str) -> Figure:
    """Labels, a compact legend and a tight layout: the last lines of every single-axes figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def _budget_axis(ax, budgets) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(int(b) for b in budgets))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])


def metric_vs_budget(
    streams: pd.DataFrame, column: str, ylabel: str, *, transform=None, title: str = "",
    mode: str = "original", log_y: bool = False,
) -> Figure:  # fmt: skip
    """A line per policy with its 95% CI band; the full cache as a horizontal reference."""
    theme()
    s = summarize_streams(streams[streams["position_mode"] == mode], column, transform)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    budgets = s.loc[s["strategy"] != "full", "budget"]
    for name in ordered(s["strategy"]):
        g = s[s["strategy"] == name].sort_values("budget")
        if name == "full":
            ref = g.iloc[0]
            ax.axhline(ref["point"], color=color(name), ls="--", lw=1.2, label=f"{label(name)} cache")
            ax.axhspan(ref["low"], ref["high"], color=color(name), alpha=0.12)
            continue
        ax.plot(g["budget"], g["point"], marker="o", ms=4, color=color(name), label=label(name))
        ax.fill_between(g["budget"], g["low"], g["high"], color=color(name), alpha=0.15)
    if len(budgets):
        _budget_axis(ax, budgets)
    if log_y:
        _log_y(ax)
    title = title or f"{ylabel} vs budget ({mode} positions, 95% CI)"
    return _finish(fig, ax, "KV budget (entries per layer)", ylabel, title)


def ppl_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    return metric_vs_budget(streams, "nll", "perplexity", transform=np.exp, mode=mode, log_y=True)


def kl_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    return metric_vs_budget(streams, "kl", "KL(p_full || p_policy) [nats]", mode=mode, log_y=False)


def agreement_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    return metric_vs_budget(streams, "agree", "top-1 agreement with the full cache", mode=mode)


def nll_vs_position(curves: pd.DataFrame, budget: int, mode: str = "original") -> Figure:
    """Mean NLL by token position (log x) per policy at one budget: the StreamingLLM figure."""
    theme()
    c = curves[
        (curves["position_mode"] == mode) & ((curves["budget"] == budget) | (curves["strategy"] == "full"))
    ]
    c = c.groupby(["strategy", "position"], as_index=False)["nll"].mean()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in ordered(c["strategy"]):
        g = c[c["strategy"] == name].sort_values("position")
        ax.plot(
            g["position"], g["nll"], color=color(name), label=label(name), ls="--" if name == "full" else "-"
        )
    ax.axvline(budget, color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log")
    title = f"NLL by position, budget {budget} ({mode} positions)"
    return _finish(fig, ax, "token position in the stream", "NLL [nats]", title)


def quality_vs_memory(runs: pd.DataFrame, mode: str = "original") -> Figure:
    """Perplexity against KV bytes held per sequence: the Pareto view (means over seeds)."""
    theme()
    r = (
        runs[runs["position_mode"] == mode]
        .groupby(["strategy", "budget"], as_index=False)[["kv_bytes", "ppl"]]
        .mean()
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in ordered(r["strategy"]):
        g = r[r["strategy"] == name].sort_values("kv_bytes")
        ax.plot(g["kv_bytes"] / 1024, g["ppl"], marker="o", ms=4, color=color(name), label=label(name),
                ls="none" if name == "full" else "-")  # fmt: skip
    pts = r.sort_values("kv_bytes")
    front = pts[pts["ppl"] <= pts["ppl"].cummin()]
    ax.step(
        front["kv_bytes"] / 1024,
        front["ppl"],
        where="post",
        color="k",
        lw=0.8,
        alpha=0.5,
        label="Pareto front",
    )
    ax.set_xscale("log")
    _log_y(ax)
    title = f"Quality vs KV memory ({mode} positions)"
    return _finish(fig, ax, "KV cache held per sequence [KiB]", "perplexity", title)


def throughput(runs: pd.DataFrame) -> Figure:
    """Token-steps per second per policy (log scale) and the share of step time inside the policy."""
    theme()
    r = runs.groupby("strategy", as_index=False)[["token_steps_per_s", "policy_time_share"]].median()
    names = ordered(r["strategy"])
    r = r.set_index("strategy").loc[names].reset_index()
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8))
    axes[0].barh([label(n) for n in names], r["token_steps_per_s"], color=[color(n) for n in names])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("token-steps / s (median over runs)")
    axes[1].barh([label(n) for n in names], 100 * r["policy_time_share"], color=[color(n) for n in names])
    axes[1].set_xlabel("% of step time in the policy")
    axes[1].set_yticklabels([])
    fig.suptitle("Speed and policy overhead")
    fig.tight_layout()
    return fig


def sink_mass(runs: pd.DataFrame) -> Figure:
    """Full-cache attention on the first 4 positions, per layer (are there attention sinks?)."""
    theme()
    cols = sorted((c for c in runs if c.startswith("sink_mass_per_layer[")), key=lambda c: int(c[20:-1]))
    vals = runs[cols].mean()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    ax.bar([f"L{int(c[20:-1])}" for c in cols], 100 * vals.to_numpy(), color="0.4")
    ax.set_ylabel("% attention on positions 0-3")
    ax.set_xlabel("layer")
    ax.set_title("Attention mass on the first positions (full cache)")
    fig.tight_layout()
    return fig


def position_modes(streams: pd.DataFrame) -> Figure:
    """`original` vs `cache` positions side by side, per policy and budget (perplexity, 95% CI)."""
    theme()
    s = summarize_streams(streams[streams["strategy"] != "full"], "nll", np.exp)
    budgets = sorted(s["budget"].unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.8), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], budgets, strict=True):
        g = s[s["budget"] == b]
        names = ordered(g["strategy"])
        x = np.arange(len(names))
        for k, (mode, hatch) in enumerate((("original", ""), ("cache", "//"))):
            m = g[g["position_mode"] == mode].set_index("strategy").reindex(names)
            err = np.vstack([m["point"] - m["low"], m["high"] - m["point"]])
            ax.bar(x + (k - 0.5) * 0.4, m["point"], 0.4, yerr=err, color=[color(n) for n in names],
                   hatch=hatch, edgecolor="k", lw=0.5, label=mode)  # fmt: skip
        ax.set_xticks(x)
        ax.set_xticklabels([label(n) for n in names], rotation=40, ha="right")
        ax.set_title(f"budget {b}")
        _log_y(ax)
    axes[0][0].set_ylabel("perplexity")
    axes[0][-1].legend(title="positions", fontsize=8)
    fig.suptitle("Positions after eviction: original vs re-indexed (cache)")
    fig.tight_layout()
    return fig


def attention_heatmap(attention: pd.DataFrame) -> Figure:
    """Mean full-cache attention by key position (log-spaced buckets) and layer: are there sinks?"""
    from matplotlib.colors import LogNorm

    theme()
    a = attention.groupby(["layer", "key_position"], as_index=False)["attention"].mean()
    n = int(a["key_position"].max()) + 1
    edges = position_buckets(n, num=24) - 1  # key positions start at 0
    a["bucket"] = np.searchsorted(edges, a["key_position"].to_numpy(), side="right") - 1
    grid = a.pivot_table(index="layer", columns="bucket", values="attention", aggfunc="mean")
    ends = np.append(edges[1:] - 1, n - 1)  # last position of each bucket
    labels = [str(edges[b]) if ends[b] == edges[b] else f"{edges[b]}-{ends[b]}" for b in grid.columns]
    fig, ax = plt.subplots(figsize=(8.8, 0.7 * len(grid) + 1.8))
    positive = grid.to_numpy()[grid.to_numpy() > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-5), vmax=positive.max()) if positive.size else None
    sns.heatmap(grid, ax=ax, cmap="magma", norm=norm, cbar_kws={"label": "mean attention received"},
                xticklabels=labels, yticklabels=[f"L{i}" for i in grid.index])  # fmt: skip
    ax.set_xlabel("key position")
    ax.set_ylabel("layer")
    ax.set_title("Where the model attends (full cache; uniform would be 1/(query position + 1))")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right", fontsize=7)
    fig.tight_layout()
    return fig


def recall_heatmaps(recall: pd.DataFrame, column: str = "exact_greedy", mode: str = "original") -> Figure:
    """Recall accuracy by needle depth x budget, one heatmap per policy (5 per row): where windowed and
    score-based policies differ most."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    theme()
    r = recall[recall["position_mode"] == mode]
    if column not in r or r[column].isna().all():
        column = "exact_teacher_forced"
    names = ordered(r["strategy"])
    ncol = min(5, len(names))
    nrow = -(-len(names) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(2.7 * ncol + 1.4, 2.6 * nrow + 0.8), squeeze=False,
                             layout="constrained")  # fmt: skip
    for k, (ax, name) in enumerate(zip(axes.flat, names, strict=False)):  # spare panels stay empty
        g = r[r["strategy"] == name]
        ax.set_title(label(name), fontsize=10)
        if g[column].isna().all():  # the oracle cannot generate: no greedy score
            ax.text(0.5, 0.5, "n/a\n(cannot generate)", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        grid = g.pivot_table(index="depth", columns="budget", values=column, aggfunc="mean")
        sns.heatmap(100 * grid.astype(float), ax=ax, vmin=0, vmax=100, cmap="viridis", annot=True, fmt=".0f",
                    cbar=False, annot_kws={"fontsize": 8})  # fmt: skip
        ax.set_xlabel("budget")
        ax.set_ylabel("needle depth" if k % ncol == 0 else "")
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    fig.colorbar(ScalarMappable(Normalize(0, 100), "viridis"), ax=axes, label="% recalled", shrink=0.8)
    what = "greedy decoding" if column == "exact_greedy" else "teacher-forced"
    fig.suptitle(f"Pass-key recall, exact match by {what} ({mode} positions)")
    return fig


def _variants(names) -> list[str]:
    """Training variants in a stable order: the experiment's base first, then by name."""
    names = sorted(set(names))
    return (["base"] if "base" in names else []) + [n for n in names if n != "base"]


def sink_by_variant(runs: pd.DataFrame, stat: str = "max") -> Figure:
    """Full-cache attention on position 0 per layer (max or mean over heads), one row per training
    variant: which recipes grow an attention sink, and in which layers."""
    theme()
    rows = {v: getattr(m, stat)(axis=1) for v, m in _first_token_mass(runs).items()}
    if not rows:
        raise ValueError("sink_by_variant needs full-cache runs in the original position mode")
    variants = _variants(rows)
    width = max(len(v) for v in rows.values())
    grid = pd.DataFrame(
        [np.pad(rows[v], (0, width - len(rows[v])), constant_values=np.nan) for v in variants],
        index=variants, columns=[f"L{i}" for i in range(width)],
    )  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.0 * width + 3.2, 0.42 * len(variants) + 1.6))
    sns.heatmap(100 * grid, ax=ax, cmap="rocket_r", vmin=0, annot=True, fmt=".0f",
                cbar_kws={"label": "% attention on position 0"})  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("training variant")
    ax.set_title(f"Attention on the first token ({stat} over heads, full cache)")
    fig.tight_layout()
    return fig


EVICTION_ARMS = (("window", "original"), ("streaming_llm", "original"), ("streaming_llm", "cache"))


def eviction_ratios(streams: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, strategy, position_mode) of the evicting policies: exp(mean NLL - mean full-cache NLL)
    per stream, i.e. perplexity relative to the full cache, with its 95% bootstrap CI (point, low, high)."""
    s = streams[streams["strategy"] != "full"].assign(delta=lambda d: d["nll"] - d["nll_full"])
    return summarize_streams(s, "delta", np.exp, keys=("variant", "strategy", "position_mode"))


def eviction_by_variant(streams: pd.DataFrame) -> Figure:
    """Perplexity of a sliding window and of StreamingLLM (both position modes) relative to the full
    cache, per training variant: exp(mean NLL - mean full-cache NLL) with a 95% bootstrap CI over
    (seed, stream) units (points, so that a few percent stay visible). Above 1 = worse than the full cache."""
    theme()
    r = eviction_ratios(streams).set_index(["variant", "strategy", "position_mode"])
    variants = _variants(r.index.get_level_values("variant"))
    arms = [a for a in EVICTION_ARMS if any((v, *a) in r.index for v in variants)]
    fig, ax = plt.subplots(figsize=(0.6 * len(variants) * len(arms) / 2 + 3.0, 4.6))
    x = np.arange(len(variants))
    w = 0.8 / max(1, len(arms))
    for k, (name, mode) in enumerate(arms):
        a = r.reindex([(v, name, mode) for v in variants])  # NaN where a variant lacks the arm
        err = [a["point"] - a["low"], a["high"] - a["point"]]
        ax.errorbar(x + (k - (len(arms) - 1) / 2) * w, a["point"], yerr=err, color=color(name), capsize=2,
                    fmt="s" if mode == "cache" else "o", mfc="white" if mode == "cache" else color(name),
                    ls="none", label=f"{label(name)} ({mode})")  # fmt: skip
    ax.axhline(1.0, color="k", lw=0.8)
    _log_y(ax)
    budget = sorted(set(streams.loc[streams["strategy"] != "full", "budget"]))
    ax.set_xticks(x)
    ax.set_xticklabels(variants, rotation=40, ha="right")
    return _finish(
        fig,
        ax,
        "training variant",
        "perplexity / full-cache perplexity",
        f"What evicting the first tokens costs (budget {', '.join(map(str, budget))})",
    )


def _first_token_mass(runs: pd.DataFrame) -> dict[str, np.ndarray]:
    """variant -> [L, H] full-cache attention on position 0 (original positions, mean over seeds)."""
    full = runs[(runs["strategy"] == "full") & (runs["position_mode"] == "original")]
    cols = [c for c in full if c.startswith("first_position_mass_per_head[")]
    cols = sorted(cols, key=lambda c: int(c.split("[")[1][:-1]))
    out = {}
    for variant, g in full.groupby("variant"):
        L, H = int(g["n_layer"].iloc[0]), int(g["n_head"].iloc[0])
        out[variant] = g[cols[: L * H]].to_numpy(dtype=float).mean(0).reshape(L, H)
    return out


def sink_trend(runs: pd.DataFrame, axes: dict[str, dict[str, float]]) -> Figure:
    """The sink against a scale knob, one column per knob: `axes` maps an x label to {variant: x}
    (e.g. {"training steps": {"steps200": 200, "base": 400, "steps800": 800}}). Top: attention on the
    first token (the strongest head of any layer, and the mean over heads and layers). Bottom: perplexity
    of a window and of StreamingLLM relative to the full cache (original positions, mean over seeds)."""
    theme()
    mass = _first_token_mass(runs)
    ppl = runs[runs["position_mode"] == "original"].groupby(["variant", "strategy"])["ppl"].mean()
    fig, grid = plt.subplots(2, len(axes), figsize=(4.2 * len(axes), 6.4), squeeze=False, sharey="row")
    for col, (xlabel, points) in enumerate(axes.items()):
        pts = sorted((x, v) for v, x in points.items() if v in mass)
        xs = [x for x, _ in pts]
        top, bottom = grid[0][col], grid[1][col]
        top.plot(xs, [100 * mass[v].max() for _, v in pts], "o-", color="0.15", label="strongest head")
        top.plot(xs, [100 * mass[v].mean() for _, v in pts], "s--", color="0.55", label="mean over heads")
        for name in ("window", "streaming_llm"):
            ys = [ppl.get((v, name), np.nan) / ppl.get((v, "full"), np.nan) for _, v in pts]
            bottom.plot(xs, ys, "o-", color=color(name), label=label(name))
        bottom.axhline(1.0, color="k", lw=0.8)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}\n{v}" for x, v in pts], fontsize=8)
        bottom.set_xlabel(xlabel)
    grid[0][0].set_ylabel("% attention on position 0")
    grid[1][0].set_ylabel("perplexity / full cache")
    grid[0][0].legend(fontsize=8)
    grid[1][0].legend(fontsize=8)
    fig.suptitle("Does a sink grow with training and size, and does evicting it hurt?")
    fig.tight_layout()
    return fig
