"""Figures as pure functions: tidy frames in, a matplotlib Figure out. One theme, one policy order and
colour everywhere. Confidence intervals: 95% bootstrap over (seed, stream) units.

Each figure registers itself where it is defined (`@figure`: the tables it reads, when a sweep supports it,
its automatic arguments). Figures are built outside pyplot (`_subplots`), so importing or drawing sets no
backend and keeps no global figure list: the caller saves the Figure (PNG and PDF render on their own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import rc_context
from matplotlib.artist import setp
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from evictlab.analysis.stats import (
    RUNS_REFERENCE,
    SETTING_ORDER,
    PolicyOrder,
    curve_band,
    evicting,
    eviction_arms,
    eviction_ratios,
    first_position_mass,
    is_reference,
    layer_values,
    mode_ratios,
    paired_delta,
    pool_buckets,
    reference,
    run_labels,
    run_settings,
    sampled_runs,
    split_settings,
    subject_caption,
    summarize_streams,
    training_labels,
    variants,
)
from evictlab.results import position_buckets

_PALETTE = sns.color_palette("tab10", 10)
_TRAINING_MARKERS = ("x", "^", "s", "v", "D", "P")  # one per training run of a group (ablations)


class Policies(PolicyOrder):
    """PolicyOrder plus each policy's colour: fixed by its order, so a policy keeps its colour in every
    figure whatever else is drawn beside it (tab10 for the built-in orders 0-9, then hues spread by the
    golden ratio, distinct for any number of policies)."""

    def color(self, name: str):
        return policy_color(self.order.get(name, 100))

    def marker(self, name: str) -> str:
        """A marker fixed by the order, so overlapping lines stay apart."""
        return MARKERS[self.order.get(name, 100) % len(MARKERS)]

    def linestyle(self, name: str):
        return LINESTYLES[self.order.get(name, 100) % len(LINESTYLES)]


SINK_THRESHOLD = 0.3  # Gu et al.'s sink head: at least this share of its attention on position 0
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)))


def policy_color(order: int):
    """tab10 for the built-in orders; hues spread by the golden ratio beyond, darker for a policy's runs
    told apart by a setting (orders from SETTING_ORDER), so they stay apart from tab10's medium tones."""
    if 0 <= order < len(_PALETTE):
        return _PALETTE[order]
    import colorsys

    dark = order >= SETTING_ORDER
    return colorsys.hsv_to_rgb((0.11 + 0.618034 * order) % 1.0, 0.8 if dark else 0.65, 0.45 if dark else 0.72)


def _subplots(nrows: int = 1, ncols: int = 1, *, figsize, layout=None, **kw):
    """A Figure and its axes (as plt.subplots) built outside pyplot, on an Agg canvas of its own: no
    global backend, no global figure list."""
    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kw)


@contextmanager
def style() -> Iterator[None]:
    """evictlab's figure style (seaborn's paper context, whitegrid, its colour codes) inside the block only:
    matplotlib's rcParams and colour codes are what they were after it. Draw and save a figure inside one
    block (matplotlib makes tick labels when it renders, from the rcParams of that moment)."""
    from matplotlib import colors as mcolors

    codes = {c: mcolors.colorConverter.colors[c] for c in "bgrmyck"}
    with rc_context():
        sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)
        try:
            yield
        finally:
            mcolors.colorConverter.colors.update(codes)
            mcolors.colorConverter.cache.clear()


def _log_y(ax) -> None:
    """Log y axis with plain numbers (2.5, 3, 4) instead of 10^x labels; a linear one when the data span
    less than a factor of 1.5 (a log axis over 1.00-1.01 labels its ticks 1.01, 1.01, 1, 1)."""
    from matplotlib.ticker import MaxNLocator

    low, high = ax.dataLim.y0, ax.dataLim.y1
    if low > 0 and high / low < 1.5:
        ax.yaxis.set_major_locator(MaxNLocator(6))
        return
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    ax.tick_params(axis="y", which="minor", labelsize=7)


# the leading digits of the minor ticks a log axis labels when it spans more than one decade: fewer as it
# spans more (within one decade, every minor tick); never one within 12% of a power of ten (0.9 under 1)
_MINOR_DIGITS = ((2.0, {2, 3, 5}), (3.0, {2, 5}))


def _plain_log_labels(axis) -> None:
    """A log axis labelled with plain numbers (%.3g): every power of ten, and the minor ticks that fit."""

    def minor(x: float, _pos) -> str:
        low, high = sorted(axis.get_view_interval())
        decades = np.log10(high / low) if low > 0 else np.inf
        exponent = np.log10(x)
        if abs(exponent - round(exponent)) < 0.05:
            return ""
        if decades > 1:
            digits = next((d for most, d in _MINOR_DIGITS if decades <= most), set())
            if round(x / 10 ** np.floor(exponent)) not in digits:
                return ""
        return f"{x:.3g}"

    axis.set_major_formatter(mticker.FormatStrFormatter("%.3g"))
    axis.set_minor_formatter(mticker.FuncFormatter(minor))


def _finish(fig: Figure, ax, xlabel: str, ylabel: str, title: str) -> Figure:
    """Labels, the legend beside the axes (never on the data) and a tight layout: the last lines of every
    single-axes figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    _legend_outside(ax)
    fig.tight_layout()
    return fig


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def _policy_line(ax, P, name: str, x, y, low=None, high=None) -> None:
    """One policy's line: its colour, marker and line style (fixed by its order), and its CI band."""
    color = P.color(name)
    ax.plot(x, y, marker=P.marker(name), ms=4, ls=P.linestyle(name), color=color, label=P.label(name))
    if low is not None:
        ax.fill_between(x, low, high, color=color, alpha=0.12, lw=0)


def _budget_axis(ax, budgets) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(int(b) for b in budgets))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])


# ------------------------------------------------------------------------------------ the registry
# One registry for the sweep report (every figure whose `applies` holds, with `auto` arguments) and the
# paper figures (experiments/<name>/figures.yaml names figures and their arguments). A figure reads the
# aggregated tables (evictlab/results.py: TABLES, plus "runs" = wide(results)).

Tables = dict[str, pd.DataFrame]


@dataclass(frozen=True)
class FigureSpec:
    draw: Callable[..., Figure]  # (tables, **args) -> Figure
    applies: Callable[[Tables], bool]  # does a sweep's tables support it
    auto: Callable[[Tables], dict] = lambda t: {}  # its arguments when the report draws it
    per_variant: bool = False  # compares training variants (else it shows one model: the first variant)


def _mode(t: Tables) -> str:
    modes = set(t["streams"]["position_mode"])
    return "original" if "original" in modes else sorted(modes)[0]


def _many_variants(t: Tables) -> bool:
    return "variant" in t["streams"] and t["streams"]["variant"].nunique() > 1


def _has(table: str, column: str | None = None, metric: str | None = None) -> Callable[[Tables], bool]:
    def check(t: Tables) -> bool:
        frame = t.get(table, pd.DataFrame())
        if frame.empty or (column is not None and column not in frame):
            return False
        return metric is None or bool((frame["metric"] == metric).any())

    return check


def _middle_budget(t: Tables) -> dict:
    budgets = sorted(set(evicting(t["curves"])["budget"]))
    return {"budget": budgets[len(budgets) // 2], "mode": _mode(t)}


def _mode_arg(t: Tables) -> dict:
    return {"mode": _mode(t)}


def _trend_args(t: Tables) -> dict:
    return {"axes": trend_axes(t["results"])}


def _kl(t: Tables) -> bool:
    return "kl" in t["streams"]


def _paired(t: Tables) -> bool:
    return "nll_full" in t["streams"] and not evicting(t["streams"]).empty


def _two_modes(t: Tables) -> bool:
    return {"original", "cache"} <= set(t["streams"]["position_mode"])


def _evicting_budgets(t: Tables) -> bool:
    return not evicting(t["curves"]).empty


def _sink_counts(t: Tables) -> bool:
    """A sweep over the number of initial positions kept, of one evicting policy (StreamingLLM's sinks, or
    the recompute window's) and nothing else evicting."""
    column = "cfg.strategy.params.n_sink"
    if "nll_full" not in t["streams"] or column not in t.get("results", pd.DataFrame()):
        return False
    policies = set(evicting(t["streams"])["strategy"])
    return len(policies) == 1 and t["results"][column].nunique() > 1


def _arms(t: Tables) -> bool:
    """A sweep over named arms (conf/arm/), compared with the full cache."""
    results = t.get("results", pd.DataFrame())
    if "nll_full" not in t["streams"] or "cfg.arm" not in results:
        return False
    return bool((results["cfg.arm"].fillna("none") != "none").any())


def _variant_sink(t: Tables) -> bool:
    return _many_variants(t) and bool(first_position_mass(t["layers"]))


def _variant_eviction(t: Tables) -> bool:
    return _many_variants(t) and "nll_full" in t["streams"] and not evicting(t["streams"]).empty


def _variant_trend(t: Tables) -> bool:
    return _variant_sink(t) and bool(trend_axes(t["results"]))


FIGURES: dict[str, FigureSpec] = {}


def figure(
    *tables: str,
    applies: Callable[[Tables], bool],
    auto: Callable[[Tables], dict] = lambda t: {},
    per_variant: bool = False,
    keywords: tuple[str, ...] = (),
) -> Callable[[Callable[..., Figure]], Callable[..., Figure]]:
    """Register the decorated function under its name: drawn from the named tables (in its parameters'
    order) when `applies` holds, with `auto`'s arguments in the sweep report. `keywords`: tables passed
    by name where the sweep has them (e.g. results, to tell a policy's runs apart)."""

    def register(fn: Callable[..., Figure]) -> Callable[..., Figure]:
        def draw(t: Tables, **args) -> Figure:
            named = {k: t[k] for k in keywords if k in t}
            return fn(*(t[name] for name in tables), **named, **args)

        FIGURES[fn.__name__] = FigureSpec(draw, applies, auto, per_variant)
        return fn

    return register


# ------------------------------------------------------------------------------------ the figures


def metric_vs_budget(
    streams: pd.DataFrame,
    column: str,
    ylabel: str,
    *,
    transform=None,
    title: str = "",
    mode: str = "original",
    log_y: bool = False,
) -> Figure:
    """A line per policy with its 95% CI band; the full cache as a horizontal reference."""
    P = Policies(streams)
    s = summarize_streams(streams[streams["position_mode"] == mode], column, transform)
    fig, ax = _subplots(figsize=(7.6, 4.2))
    budgets = s.loc[~s["strategy"].map(P.is_reference), "budget"]
    for name in P.ordered(s["strategy"]):
        g = s[s["strategy"] == name].sort_values("budget")
        if P.is_reference(name):
            ref = g.iloc[0]
            ax.axhline(ref["point"], color=P.color(name), ls="--", lw=1.2, label=f"{P.label(name)} cache")
            ax.axhspan(ref["low"], ref["high"], color=P.color(name), alpha=0.12)
            continue
        _policy_line(ax, P, name, g["budget"], g["point"], g["low"], g["high"])
    if len(budgets):
        _budget_axis(ax, budgets)
    if log_y:
        _log_y(ax)
    title = title or f"{ylabel} vs budget ({mode} positions, 95% CI)\n{subject_caption(streams)}"
    return _finish(fig, ax, "KV budget (entries per layer)", ylabel, title)


@figure("streams", applies=_has("streams"), auto=_mode_arg)
def ppl_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    title = (
        f"perplexity vs budget ({mode} positions; 95% CI over streams, unpaired: cost_vs_budget pairs "
        f"each stream with the full cache)\n{subject_caption(streams)}"
    )
    return metric_vs_budget(
        streams, "nll", "perplexity", transform=np.exp, mode=mode, log_y=True, title=title
    )


@figure("streams", applies=_kl, auto=_mode_arg)
def kl_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    return metric_vs_budget(streams, "kl", "KL(p_full || p_policy) [nats]", mode=mode, log_y=False)


@figure("streams", applies=_kl, auto=_mode_arg)
def agreement_vs_budget(streams: pd.DataFrame, mode: str = "original") -> Figure:
    return metric_vs_budget(streams, "agree", "top-1 agreement with the full cache", mode=mode)


@figure("streams", applies=_paired, auto=_mode_arg)
def cost_vs_budget(streams: pd.DataFrame, mode: str = "original", outlier: float = 2.0) -> Figure:
    """What each policy costs relative to the full cache: exp(mean over streams of NLL - full-cache NLL),
    with a paired 95% bootstrap CI over (seed, stream) units, against the budget (log axes). Policies
    whose cost exceeds `outlier` x at some budget get their own panel, so one far-off policy does not
    squash the others into one band."""
    P = Policies(streams)
    s = evicting(streams[streams["position_mode"] == mode]).assign(delta=paired_delta)
    r = summarize_streams(s, "delta", np.exp)
    worst = r.groupby("strategy")["point"].max()
    groups = [[n for n in P.ordered(r["strategy"]) if (worst[n] > outlier) == far] for far in (False, True)]
    groups = [g for g in groups if g]
    fig, axes = _subplots(1, len(groups), figsize=(7.4 * len(groups), 4.4), squeeze=False)
    for ax, names in zip(axes[0], groups, strict=True):
        for name in names:
            g = r[r["strategy"] == name].sort_values("budget")
            _policy_line(ax, P, name, g["budget"], g["point"], g["low"], g["high"])
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="full cache")
        _budget_axis(ax, r["budget"])
        _log_y(ax)
        ax.set_xlabel("KV budget (entries per layer)")
        ax.set_ylabel("perplexity / full-cache perplexity")
        _legend_outside(ax)
    if len(groups) > 1:  # a policy's panel is set by its worst budget
        axes[0][0].set_title(f"policies within {outlier:g}x of the full cache at every budget", fontsize=10)
        axes[0][1].set_title(f"policies beyond {outlier:g}x at some budget", fontsize=10)
    fig.suptitle(
        f"Cost of eviction relative to the full cache ({mode} positions, paired 95% CI)\n"
        f"{subject_caption(streams)}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _stream_curves(g: pd.DataFrame, col: str, smooth: int, min_tokens: int) -> pd.DataFrame:
    """One policy's curve per stream (seeds and runs pooled), its first buckets pooled to >= min_tokens
    positions (`stats.pool_buckets`), each a centred mean over `smooth` log-spaced buckets."""
    keys = ["position", "stream"] if "stream" in g else ["position"]
    if "position_start" in g:
        keys.append("position_start")
    per_stream = pool_buckets(g.groupby(keys, as_index=False)[col].mean(), col, min_tokens)
    if "stream" not in per_stream:
        per_stream = per_stream.assign(stream=0)
    if smooth > 1:  # rows are in position order within a stream
        rolled = per_stream.groupby("stream")[col].transform(
            lambda v: v.rolling(smooth, center=True, min_periods=1).mean()
        )
        per_stream[col] = rolled
    return per_stream


def _position_lines(ax, lines, P: Policies, sampled: set[str], smooth: int, min_tokens: int) -> None:
    """`nll_vs_position`'s lines: (name, curve rows, column, label) each, its 95% band over streams
    unless the run scored sampled steps only (`sampled`: a few predictions per bucket)."""
    for name, g, col, label in lines:
        g = g.dropna(subset=[col])
        thin = col == "nll" and len(g) > 0 and g["run_key"].isin(sampled).all() if "run_key" in g else False
        label = f"{label}, sampled" if thin else label
        mean = curve_band(_stream_curves(g, col, smooth, min_tokens), col)
        reference = P.is_reference(name) or col == "nll_full"
        color = P.color(name) if col == "nll" else "0.2"
        look = {"lw": 2.0, "ls": "-", "marker": None} if reference else {}
        look = look or {"lw": 1.5, "ls": P.linestyle(name), "marker": P.marker(name)}
        markevery = (P.order.get(name, 0) % 4, 4)
        ax.plot(mean["position"], mean["mean"], color=color, label=label, ms=3.5, markevery=markevery, **look)
        if "stream" in g and g["stream"].nunique() > 1 and not thin:
            ax.fill_between(mean["position"], mean["low"], mean["high"], color=color, alpha=0.15, lw=0)


@figure("curves", applies=_evicting_budgets, auto=_middle_budget, keywords=("results",))
def nll_vs_position(
    curves: pd.DataFrame,
    budget: int,
    mode: str = "original",
    context: int | None = None,
    stream_len: int | None = None,
    context_label: str = "training context",
    smooth: int = 3,
    min_tokens: int = 16,
    results: pd.DataFrame | None = None,
) -> Figure:
    """Mean NLL by token position (log x) per policy at one budget: StreamingLLM's Figure 3. `context`: the
    model's training context, marked (past it the full cache attends beyond the positions it was
    trained on); a line stops where its run's stream (or the full-cache reference's cap) ends; a band is the
    95% bootstrap CI of the mean over streams (`stats.curve_band`) where the curves keep streams apart.
    Without a full-cache run, the full cache is drawn from the runs' reference (`nll_full`).
    `stream_len`: only the runs of that stream length (a group can hold streams of several lengths).
    `smooth`: each stream's curve is a centred mean over this many neighbouring log-spaced position
    buckets (1: none); `min_tokens`: the first buckets, one position each on a log axis, are pooled until
    each holds this many (`stats.pool_buckets`); the title states both. Policies differ in line style and
    marker as well as colour (lines that coincide stay visible). With `results`, runs of one policy that
    differ in a setting (n_sink) are lines of their own (`stats.split_settings`)."""
    curves = split_settings(curves, results)
    P = Policies(curves)
    at = (curves["budget"] == budget) | is_reference(curves)
    if stream_len is not None:
        at &= curves["stream_len"] == stream_len
    c = curves[(curves["position_mode"] == mode) & at]
    sampled = sampled_runs(results)  # (a sampled run's buckets hold a few predictions each: no band)
    wide = "run_key" in c and c["run_key"].isin(sampled).any()  # (its longer legend labels)
    fig, ax = _subplots(figsize=(8.6 if wide else 7.6, 4.2))
    lines = [(name, c[c["strategy"] == name], "nll", P.label(name)) for name in P.ordered(c["strategy"])]
    if (
        not any(P.is_reference(name) for name in c["strategy"])
        and "nll_full" in c
        and c["nll_full"].notna().any()
    ):
        # every run of these streams has this reference: draw it from the first policy's runs
        first = c[c["strategy"] == P.ordered(c["strategy"])[0]]
        lines.insert(0, (RUNS_REFERENCE, first, "nll_full", "full cache (reference)"))
    _position_lines(ax, lines, P, sampled, smooth, min_tokens)
    ax.axvline(budget, color="0.5", lw=0.8, ls=":", label=f"cache budget ({budget:,})")
    if context is not None:
        ax.axvline(context, color="k", lw=1.0, ls="-.", label=f"{context_label} ({context:,})")
    ax.set_xscale("log")
    how = f"\nsmoothed over {smooth} log-spaced buckets" if smooth > 1 else ""
    if min_tokens > 1 and "position_start" in c:
        how += f"{' ' if how else chr(10)}of >= {min_tokens} positions"
    if "stream" in c and c["stream"].nunique() > 1:
        how += "\nband: 95% CI of the mean over streams"
    title = f"NLL by position, budget {budget} ({mode} positions)\n{subject_caption(c)}{how}"
    return _finish(fig, ax, "token position in the stream", "NLL [nats]", title)


@figure("runs", applies=_has("runs", "kv_bytes"), auto=_mode_arg)
def quality_vs_memory(runs: pd.DataFrame, mode: str = "original") -> Figure:
    """Perplexity against KV bytes held per sequence: the Pareto view (means over seeds)."""
    P = Policies(runs)
    r = runs[runs["position_mode"] == mode].groupby(["strategy", "budget"], as_index=False)[
        ["kv_bytes", "ppl"]
    ]
    r = r.mean()
    fig, ax = _subplots(figsize=(7.6, 4.2))
    for name in P.ordered(r["strategy"]):
        g = r[r["strategy"] == name].sort_values("kv_bytes")
        ls = "none" if P.is_reference(name) else "-"
        ax.plot(
            g["kv_bytes"] / 1024, g["ppl"], marker="o", ms=4, color=P.color(name), label=P.label(name), ls=ls
        )
    causal = r[~r["strategy"].isin(P.non_causal)]  # the oracle reads the future: drawn, never on the front
    pts = causal.sort_values("kv_bytes")
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
    ax.set_xscale("log")  # a tick at each memory the runs held (plain KiB), none between
    ax.set_xticks(sorted(r["kv_bytes"].unique() / 1024))
    ax.xaxis.set_major_formatter(mticker.StrMethodFormatter("{x:,.0f}"))
    ax.xaxis.set_minor_formatter(mticker.NullFormatter())
    _log_y(ax)
    title = f"Quality vs KV memory ({mode} positions)\n{subject_caption(runs)}"
    return _finish(fig, ax, "KV cache held per sequence [KiB]", "perplexity", title)


def pareto_front(x: np.ndarray, y: np.ndarray, x_low: bool) -> np.ndarray:
    """Indices of the points no other point beats on both axes (y higher is better; x lower is better when
    `x_low`, else higher), ordered along x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    order = np.lexsort((-y, x if x_low else -x))  # along x, and at one x the best y first (ties on x:
    # every budget of a policy holds the same memory, and the lesser points at it are beaten)
    front, best = [], -np.inf
    for i in order:
        if y[i] > best:
            front.append(i)
            best = y[i]
    return np.array(front, dtype=int)


def _tradeoff_quality(runs: pd.DataFrame) -> tuple[pd.Series, str]:
    """Quality, higher better: a task run's share of answers written exactly; a generation run's ROUGE-L
    of its continuations against the full cache's (1 = the same text); else the full cache's perplexity
    over the policy's (1 = no cost)."""
    if "task_exact" in runs and runs["task_exact"].notna().any():
        return runs["task_exact"], "answers written exactly (share)"
    if "gen_rouge_l" in runs and runs["gen_rouge_l"].notna().any():
        return runs["gen_rouge_l"], "continuations: ROUGE-L against the full cache's (1 = the same)"
    return runs["ppl_full"] / runs["ppl"], "quality: full-cache perplexity / the policy's (1 = no cost)"


def _tradeoff_points(ax, P, r: pd.DataFrame, x: str) -> None:
    """One panel's points: each policy's runs (the full cache starred, non-causal ones hollow) and, on the
    speed panel, the fused-kernel rate as an open marker joined to the explicit one."""
    for name in P.ordered(r["strategy"]):
        g = r[r["strategy"] == name].sort_values("budget")
        look = {"marker": "*", "ms": 11} if P.is_reference(name) else {"marker": P.marker(name), "ms": 5}
        face = "none" if name in P.non_causal else P.color(name)
        color = P.color(name)
        ax.plot(g[x], g["quality"], ls="none", color=color, label=P.label(name), mfc=face, **look)
        if x == "speed":
            for _, row in g.dropna(subset=["fused"]).iterrows():
                ax.plot([row["speed"], row["fused"]], [row["quality"]] * 2, color=color, lw=0.7)
                ax.plot(row["fused"], row["quality"], ls="none", mfc="white", color=color, **look)


def _tradeoff_front(ax, P, r: pd.DataFrame, x: str) -> None:
    """The Pareto front of the causal policies' points (on the speed panel, fused rates count too)."""
    causal = r[~r["strategy"].isin(P.non_causal)]
    pts = causal[[x, "quality"]].to_numpy()
    if x == "speed":
        pts = np.vstack([pts, causal.dropna(subset=["fused"])[["fused", "quality"]].to_numpy()])
    pts = pts[np.isfinite(pts).all(1)]
    if len(pts):
        front = pts[pareto_front(pts[:, 0], pts[:, 1], x_low=x == "kv_kib")]
        ax.plot(
            front[:, 0], front[:, 1], color="k", lw=0.8, alpha=0.5, ls="--", label="Pareto front (causal)"
        )


@figure("runs", applies=_has("runs", "kv_bytes"), auto=_mode_arg)
def tradeoff(runs: pd.DataFrame, mode: str = "original") -> Figure:
    """Each policy x budget: quality against the KV memory it holds (left) and against how fast it runs
    (right: decode token-steps/s through the token loop where the runs wrote answers, else the teacher-
    forced stream's token-steps/s), the full cache starred, the Pareto front of the causal policies
    marked. Where a run also decoded through the fused kernel (policies that read no attention weights),
    an open marker at that rate, joined to its explicit-attention point: the speed H2O and TOVA give up."""
    P = Policies(runs)
    r = runs[runs["position_mode"] == mode].copy()
    r["quality"], ylabel = _tradeoff_quality(r)
    decode = "decode_token_steps_per_s" in r and r["decode_token_steps_per_s"].notna().any()
    r["speed"] = r["decode_token_steps_per_s"] if decode else r["token_steps_per_s"]
    r["fused"] = r.get("decode_token_steps_per_s_fused", pd.Series(np.nan, index=r.index))
    r["kv_kib"] = r["kv_bytes"] / 1024
    r = r.groupby(["strategy", "budget"], as_index=False)[["kv_kib", "quality", "speed", "fused"]].mean()
    scored = r.groupby("strategy")["quality"].transform(lambda q: q.notna().any())
    none = [P.label(n) for n in P.ordered(r.loc[~scored, "strategy"])]  # (the oracle writes no answers)
    r = r[scored]
    fig, axes = _subplots(1, 2, figsize=(11.0, 4.4), sharey=True)
    for ax, x in zip(axes, ("kv_kib", "speed"), strict=True):
        _tradeoff_points(ax, P, r, x)
        _tradeoff_front(ax, P, r, x)
        xs = pd.concat([r[x], r["fused"]] if x == "speed" else [r[x]]).dropna()
        if xs.max() > 4 * xs.min():  # a log axis only where the values span a few-fold (else no tick)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(mticker.NullFormatter())
        else:
            ax.xaxis.set_major_locator(mticker.MaxNLocator(6))
        ax.xaxis.set_major_formatter(mticker.StrMethodFormatter("{x:,.0f}"))
        ax.grid(alpha=0.3)
    kv = sorted(r["kv_kib"].unique())
    axes[0].set_xticks(kv if len(kv) <= 6 else kv[:: -(-len(kv) // 6)])
    axes[0].set_xlabel("KV cache held per sequence [KiB]")
    speed = "decode token-steps / s" if decode else "teacher-forced token-steps / s (no decode measured)"
    if decode and "decode_source" in runs and (runs["decode_source"] == "speed.csv").any():
        speed += ", re-measured in one sitting (make speed)"
    fused = "\nopen markers: the same decode through SDPA" if r["fused"].notna().any() else ""
    axes[1].set_xlabel(speed + fused)
    axes[0].set_ylabel(ylabel)
    title = f"Quality vs memory and speed ({mode} positions)\n{subject_caption(runs)}"
    if none:  # (say so: a policy missing from the figure reads as one not run)
        title += f"\nnot drawn (writes nothing to score): {', '.join(none)}"
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[1].legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.tight_layout()
    return fig


@figure("runs", applies=_has("runs", "token_steps_per_s"))
def throughput(runs: pd.DataFrame) -> Figure:
    """Token-steps per second per policy (log scale; median over runs, whiskers from the slowest to the
    fastest run) and the share of step time inside the policy (a policy evaluated without a per-step
    policy call, on the parallel or recompute path, says so instead of drawing a zero)."""
    P = Policies(runs)
    stats = runs.groupby("strategy")[["token_steps_per_s", "policy_time_share"]]
    r, low, high = stats.median(), stats.min(), stats.max()
    names = P.ordered(r.index)
    r, low, high = r.loc[names], low.loc[names], high.loc[names]
    labels, colors = [P.label(n) for n in names], [P.color(n) for n in names]
    speed = r["token_steps_per_s"].to_numpy()
    spread = np.vstack([speed - low["token_steps_per_s"], high["token_steps_per_s"] - speed])
    fig, axes = _subplots(1, 2, figsize=(9.6, 0.32 * len(names) + 2.4))
    axes[0].barh(labels, speed, color=colors, xerr=spread, error_kw={"elinewidth": 0.8, "capsize": 2})
    axes[0].set_xscale("log")
    axes[0].set_xlabel("token-steps / s (median over runs; whiskers: slowest to fastest)")
    share = 100 * r["policy_time_share"].to_numpy()
    axes[1].barh(labels, np.nan_to_num(share), color=colors)
    paths = runs.groupby("strategy")["path"].agg(set) if "path" in runs else pd.Series(dtype=object)
    for i, name in enumerate(names):
        path = "/".join(sorted(str(x) for x in paths.get(name, set()) if pd.notna(x)))
        if path in ("parallel", "recompute") or not np.isfinite(share[i]):
            text = f"no per-step policy call ({path} path)" if path else "not measured"
            axes[1].text(0.5, i, text, va="center", fontsize=7, color="0.35")
    axes[1].set_xlabel("% of step time in the policy")
    axes[1].set_yticklabels([])
    per = runs.groupby("strategy").size()
    counts = f"{per.min()}" if per.min() == per.max() else f"{per.min()}-{per.max()}"
    threads = ""
    if "cfg.eval.threads" in runs and runs["cfg.eval.threads"].notna().any():
        threads = ", " + " / ".join(f"{int(t)}" for t in sorted(runs["cfg.eval.threads"].dropna().unique()))
        threads += " evaluation thread(s)"
    caption = subject_caption(runs)
    title = f"Speed and policy overhead ({counts} runs per policy{threads}; CPU)"
    fig.suptitle(title + (f"\n{caption}" if caption else ""))
    fig.tight_layout()
    return fig


@figure("layers", applies=_has("layers", metric="first4_mass"))
def first4_mass(layers: pd.DataFrame) -> Figure:
    """Full-cache attention on the first 4 positions, per layer (are there attention sinks?)."""
    vals = layer_values(layers, "first4_mass").groupby("layer")["value"].mean()
    fig, ax = _subplots(figsize=(5.2, 3.6))
    names = [f"L{int(layer)}" for layer in vals.index]
    ax.bar(names, 100 * vals.to_numpy(), color="0.4")
    step = -(-len(names) // 12)  # at most 12 labels (30 layers: every third)
    ax.set_xticks(range(0, len(names), step), names[::step])
    ax.set_ylabel("% attention on positions 0-3")
    ax.set_xlabel("layer")
    ax.set_title("Attention mass on the first positions (full cache)")
    fig.tight_layout()
    return fig


@figure("streams", applies=_two_modes)
def position_modes(streams: pd.DataFrame) -> Figure:
    """What re-indexing positions after eviction (`cache`) changes against keeping the text positions
    (`original`), per policy and budget: the paired perplexity ratio exp(mean over streams of NLL_cache -
    NLL_original) with a 95% bootstrap CI over the units both modes streamed (`stats.mode_ratios`)."""
    P = Policies(streams)
    e = evicting(streams)
    r = mode_ratios(streams)
    fig, ax = _subplots(figsize=(7.6, 4.2))
    for name in P.ordered(r["strategy"]):
        g = r[r["strategy"] == name].sort_values("budget")
        _policy_line(ax, P, name, g["budget"], g["point"], g["low"], g["high"])
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="no difference")
    _budget_axis(ax, r["budget"])
    _log_y(ax)
    title = f"Re-indexed (cache) against original positions: paired ratio, 95% CI\n{subject_caption(e)}"
    return _finish(fig, ax, "KV budget (entries per layer)", "perplexity ratio, cache / original", title)


@figure("streams", "results", applies=_sink_counts)
def sinks_vs_count(streams: pd.DataFrame, results: pd.DataFrame) -> Figure:
    """StreamingLLM's initial-token table as a figure: the sinks-plus-window cache's perplexity relative to
    the full cache (paired, 95% CI over streams) against the number of initial positions kept (0: a plain
    window), one line per (stream starts with BOS or not, position mode)."""
    settings = run_settings(results, {"cfg.strategy.params.n_sink": "n_sink", "cfg.dataset.bos": "bos"})
    s = evicting(streams).join(settings, on="run_key").assign(delta=paired_delta)
    r = summarize_streams(s, "delta", np.exp, keys=("bos", "position_mode", "n_sink"))
    counts = sorted(int(n) for n in r["n_sink"].unique())
    x = {n: i for i, n in enumerate(counts)}
    fig, ax = _subplots(figsize=(6.4, 4.2))
    colors = {True: _PALETTE[2], False: _PALETTE[3]}
    for (bos, mode), g in r.groupby(["bos", "position_mode"]):
        g = g.sort_values("n_sink")
        xs = [x[int(n)] for n in g["n_sink"]]
        style = {"color": colors[bool(bos)], "ls": "-" if mode == "original" else "--"}
        label = f"{'BOS first' if bool(bos) else 'no BOS'}, {mode} positions"
        ax.plot(xs, g["point"], marker="o" if mode == "original" else "s", ms=4, label=label, **style)
        ax.fill_between(xs, g["low"], g["high"], alpha=0.15, color=style["color"])
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="full cache")
    ax.set_xticks(range(len(counts)))
    ax.set_xticklabels([str(n) for n in counts])
    _log_y(ax)
    n = int(r["n"].max()) if len(r) else 0
    budget = ", ".join(str(int(b)) for b in sorted(evicting(streams)["budget"].unique()))
    title = f"Initial positions kept (budget {budget}; {n} streams, paired 95% CI)"
    return _finish(
        fig, ax, "initial positions kept (n_sink; 0 = window)", "perplexity / full-cache perplexity", title
    )


# conf/arm/'s arms in figure order (the eviction arms from least to most of the stream's start kept, then
# the interventions on the full cache) and their names in figures; any other arm follows, by its name
ARMS = {
    "window": "window (BOS evicted)",
    "recompute": "window + recompute",
    "sink_text": "1 sink: the first text token",
    "sink_bos": "1 sink: BOS",
    "recompute_bos": "window + recompute, BOS prepended",
    "sinks4": "StreamingLLM, 4 sinks",
    "bos_key": "full cache, BOS key masked",
    "bos_value": "full cache, BOS value zeroed",
}


@figure("streams", "results", applies=_arms)
def ablations(streams: pd.DataFrame, results: pd.DataFrame) -> Figure:
    """Issue 27's arms side by side: each arm's perplexity relative to the full cache (paired per stream;
    a hierarchical 95% CI over training runs, then streams, when there are several), with each training
    run's own ratio as a small marker; beside it, when the sweep holds them, BOS's key and value ablated
    one layer at a time."""
    settings = run_settings(results, {"cfg.strategy.params.layer": "layer"})
    labels = run_labels(results).rename("arm")
    s = streams[~is_reference(streams)].join(labels, on="run_key").join(settings, on="run_key")
    s = s.assign(delta=paired_delta(s), layer=s.get("layer", pd.Series(-1, index=s.index)))
    whole = s[s["layer"].fillna(-1).astype(int) < 0]
    by_layer = s[s["layer"].fillna(-1).astype(int) >= 0]
    modes = sorted(whole["position_mode"].unique(), key=lambda m: m != "original")
    r = summarize_streams(whole, "delta", np.exp, keys=("arm", "position_mode"))
    per_run = whole.groupby(["arm", "position_mode", "checkpoint"])["delta"].mean().map(np.exp)
    arms = sorted(r["arm"].unique(), key=lambda a: (list(ARMS).index(a) if a in ARMS else len(ARMS), a))
    legend_rows = len(modes) + per_run.index.get_level_values("checkpoint").nunique()  # below the panel
    height = 0.42 * len(arms) + 1.9 + 0.25 * legend_rows
    if len(by_layer):
        fig, axes = _subplots(
            1, 2, figsize=(11.5, height), squeeze=False, gridspec_kw={"width_ratios": [1.5, 1]}
        )
    else:
        fig, axes = _subplots(1, 1, figsize=(7.4, height), squeeze=False, gridspec_kw=None)
    _arms_panel(axes[0, 0], r, per_run, arms, modes, training_labels(results))
    trainings = int(r["clusters"].max()) if len(r) else 0
    budget = ", ".join(str(int(b)) for b in sorted(evicting(whole)["budget"].unique())) or "-"
    ci = "95% CI over training runs, then streams" if trainings > 1 else "95% CI over streams"
    runs_word = f"{trainings} training run{'s' if trainings != 1 else ''}"
    axes[0, 0].set_title(
        f"What the first token does: budget {budget}, {runs_word}, paired {ci}\n{subject_caption(whole)}",
        fontsize=10,
    )
    if len(by_layer):
        _layers_panel(axes[0, 1], by_layer, r, modes)
    fig.tight_layout()
    return fig


def _arms_panel(ax, r: pd.DataFrame, per_run: pd.Series, arms: list, modes: list, named: dict) -> None:
    """The ablations' arms as rows: per position mode the mean ratio with its CI, and each training run's
    own ratio (`named`: checkpoint -> its training's distinguishing settings)."""
    for k, mode in enumerate(modes):
        offset = 0.0 if len(modes) == 1 else (k - 0.5) * 0.3
        g = r[r["position_mode"] == mode].set_index("arm")
        ys = [arms.index(a) + offset for a in g.index]
        err = [g["point"] - g["low"], g["high"] - g["point"]]
        label = f"{mode} positions, mean [95% CI]"
        ax.errorbar(g["point"], ys, xerr=err, fmt="o", ms=5, capsize=3, color=_PALETTE[k], label=label)
        runs = per_run.xs(mode, level="position_mode")
        for j, (checkpoint, one) in enumerate(runs.groupby(level="checkpoint")):
            name = f"training {named[checkpoint]}" if len(named) > 1 else "one training run"
            rows = [arms.index(a) + offset for a in one.index.get_level_values("arm")]
            marker = _TRAINING_MARKERS[j % len(_TRAINING_MARKERS)]
            label = name if k == 0 else None
            ax.scatter(one.to_numpy(), rows, marker=marker, s=24, color="0.3", lw=1, zorder=3, label=label)
    ax.axvline(1.0, color="k", lw=0.8, ls=":", label="full cache")
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels([ARMS.get(a, a) for a in arms])
    ax.invert_yaxis()
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlabel("perplexity / full-cache perplexity")
    # below the panel, off the data (the training markers sit anywhere along the rows)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)


def _layers_panel(ax, by_layer: pd.DataFrame, r: pd.DataFrame, modes: list) -> None:
    """BOS's key or value ablated in one layer at a time, against the same ablation in every layer."""
    rl = summarize_streams(by_layer, "delta", np.exp, keys=("arm", "layer"))
    for k, (arm, g) in enumerate(rl.groupby("arm")):
        g = g.sort_values("layer")
        color = _PALETTE[2 + k]
        ax.plot(g["layer"], g["point"], marker="o", ms=4, color=color, label=ARMS.get(arm, arm))
        ax.fill_between(g["layer"], g["low"], g["high"], color=color, alpha=0.15, lw=0)
        if arm in set(r["arm"]):  # the same ablation in every layer at once
            every = r[(r["arm"] == arm) & (r["position_mode"] == modes[0])]["point"]
            ax.axhline(float(every.iloc[0]), color=color, lw=0.8, ls="--", label="... in every layer")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xticks(sorted(rl["layer"].unique()))
    _log_y(ax)
    ax.set_xlabel("layer ablated (one at a time)")
    ax.set_ylabel("perplexity / full-cache perplexity")
    ax.set_title("BOS ablated in one layer", fontsize=10)
    # below the panel: the per-layer values and both "every layer" levels fill its height
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)


@figure("attention", applies=_has("attention"))
def attention_heatmap(attention: pd.DataFrame) -> Figure:
    """Mean full-cache attention by key position (log-spaced buckets) and layer: are there sinks?"""
    from matplotlib.colors import LogNorm

    a = attention.groupby(["layer", "key_position"], as_index=False)["attention"].mean()
    n = int(a["key_position"].max()) + 1
    edges = position_buckets(n, num=24) - 1  # key positions start at 0
    a["bucket"] = np.searchsorted(edges, a["key_position"].to_numpy(), side="right") - 1
    grid = a.pivot_table(index="layer", columns="bucket", values="attention", aggfunc="mean")
    ends = np.append(edges[1:] - 1, n - 1)  # last position of each bucket
    labels = [str(edges[b]) if ends[b] == edges[b] else f"{edges[b]}-{ends[b]}" for b in grid.columns]
    fig, ax = _subplots(figsize=(8.8, 0.7 * len(grid) + 1.8))
    positive = grid.to_numpy()[grid.to_numpy() > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-5), vmax=positive.max()) if positive.size else None
    sns.heatmap(
        grid,
        ax=ax,
        cmap="magma",
        norm=norm,
        cbar_kws={"label": "mean attention received"},
        xticklabels=labels,
        yticklabels=[f"L{i}" for i in grid.index],
    )
    ax.set_xlabel("key position")
    ax.set_ylabel("layer")
    ax.set_title("Where the model attends (full cache; uniform would be 1/(query position + 1))")
    setp(ax.get_xticklabels(), rotation=45, ha="right", fontsize=7)
    fig.tight_layout()
    return fig


@figure("generations", applies=_has("generations"), auto=_mode_arg)
def generation_agreement(generations: pd.DataFrame, mode: str = "original") -> Figure:
    """Free-running generation against the full cache, one panel per budget: the share of streams whose
    greedy continuation under the policy is still the full cache's, token for token, after k new tokens
    (its tokens to the first divergence reach k), a step line per evicting policy, its mean ROUGE-L against
    the full cache's continuation in the legend."""
    P = Policies(generations)
    here = generations[generations["position_mode"] == mode]
    n_new = int(here["first_divergence"].max()) if len(here) else 1  # (the full cache's rows: all it wrote)
    g = evicting(here)
    budgets = sorted(g["budget"].unique())
    fig, axes = _subplots(
        1, max(1, len(budgets)), figsize=(4.6 * max(1, len(budgets)) + 2.2, 4.0), squeeze=False
    )
    k = np.arange(0, n_new + 1)
    for ax, budget in zip(axes.flat, budgets, strict=True):
        for name in P.ordered(g["strategy"]):
            r = g[(g["strategy"] == name) & (g["budget"] == budget)]
            if r.empty:
                continue
            still = (r["first_divergence"].to_numpy()[None, :] >= k[:, None]).mean(axis=1)
            label = f"{P.label(name)} (ROUGE-L {r['rouge_l'].mean():.2f})"
            ax.step(k, 100 * still, where="post", color=P.color(name), label=label, lw=1.6)
        ax.set_ylim(-3, 103)
        ax.set_xlim(0, n_new)
        ax.set_title(f"budget {int(budget)}", fontsize=10)
        ax.set_xlabel("new tokens written")
        ax.legend(fontsize=7, loc="upper right")
    axes.flat[0].set_ylabel("% of streams still identical to the full cache")
    n = g.groupby(["strategy", "budget"]).size()
    fig.suptitle(
        f"Greedy continuations against the full cache's from the same prefix ({mode} positions; "
        f"{n.min()} streams each)\n{subject_caption(g.drop(columns=['stream'], errors='ignore'))}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


@figure("recall", applies=_has("recall"), auto=_mode_arg)
def recall_heatmaps(recall: pd.DataFrame, column: str = "exact_greedy", mode: str = "original") -> Figure:
    """Recall accuracy by needle depth x budget, one heatmap per policy (5 per row): where windowed and
    score-based policies differ most."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    P = Policies(recall)
    r = recall[recall["position_mode"] == mode]
    if column not in r or r[column].isna().all():
        column = "exact_teacher_forced"
    names = P.ordered(r["strategy"])
    ncol = min(5, len(names))
    nrow = -(-len(names) // ncol)
    size = (2.7 * ncol + 1.4, 2.6 * nrow + 0.8)
    fig, axes = _subplots(nrow, ncol, figsize=size, squeeze=False, layout="constrained")
    for k, (ax, name) in enumerate(zip(axes.flat, names, strict=False)):  # spare panels stay empty
        g = r[r["strategy"] == name]
        ax.set_title(P.label(name), fontsize=10)
        if g[column].isna().all():  # a non-causal policy cannot generate: no greedy score
            ax.text(0.5, 0.5, "n/a\n(cannot generate)", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        grid = g.pivot_table(index="depth", columns="budget", values=column, aggfunc="mean")
        sns.heatmap(
            100 * grid.astype(float),
            ax=ax,
            vmin=0,
            vmax=100,
            cmap="viridis",
            annot=True,
            fmt=".0f",
            cbar=False,
            annot_kws={"fontsize": 8},
        )
        ax.set_xlabel("budget")
        ax.set_ylabel("needle depth" if k % ncol == 0 else "")
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    fig.colorbar(ScalarMappable(Normalize(0, 100), "viridis"), ax=axes, label="% recalled", shrink=0.8)
    what = "greedy decoding" if column == "exact_greedy" else "teacher-forced"
    cell = r.groupby(["strategy", "budget", "depth"]).size()
    per = f"{cell.min()}" if cell.min() == cell.max() else f"{cell.min()}-{cell.max()}"
    fig.suptitle(
        f"Pass-key recall, exact match, {what} ({mode} positions): each cell is {per} streams\n"
        f"{subject_caption(r.drop(columns=['stream'], errors='ignore'))}"
    )
    return fig


@figure("layers", applies=_variant_sink, per_variant=True)
def sink_by_variant(layers: pd.DataFrame, stat: str = "max") -> Figure:
    """Full-cache attention on position 0 per layer (max or mean over heads), one row per training
    variant: which recipes grow an attention sink, and in which layers."""
    rows = {v: getattr(m, stat)(axis=1) for v, m in first_position_mass(layers).items()}
    if not rows:
        raise ValueError("sink_by_variant needs full-cache runs in the original position mode")
    order = variants(rows)
    width = max(len(v) for v in rows.values())
    padded = [np.pad(rows[v], (0, width - len(rows[v])), constant_values=np.nan) for v in order]
    grid = pd.DataFrame(padded, index=order, columns=[f"L{i}" for i in range(width)])
    fig, ax = _subplots(figsize=(1.0 * width + 3.2, 0.42 * len(order) + 1.6))
    from matplotlib.colors import TwoSlopeNorm

    # anchored at Gu et al.'s sink threshold: a head with 30% of its attention on position 0 is a sink
    # (the scale's midpoint), so 12% reads as weak whatever the largest value in the grid
    sns.heatmap(
        100 * grid,
        ax=ax,
        cmap="rocket_r",
        norm=TwoSlopeNorm(vcenter=100 * SINK_THRESHOLD, vmin=0, vmax=100),
        annot=True,
        fmt=".0f",
        cbar_kws={"label": "% attention on position 0 (sink: >= 30)"},
    )
    ax.set_xlabel("layer")
    ax.set_ylabel("training variant")
    ax.set_title(f"Attention on the first token ({stat} over heads, full cache; a sink head holds >= 30%)")
    fig.tight_layout()
    return fig


@figure("streams", applies=_variant_eviction, per_variant=True)
def eviction_by_variant(streams: pd.DataFrame, arms: list | None = None) -> Figure:
    """Perplexity of each arm (an evicting policy in one position mode; default every arm the sweep ran)
    relative to the full cache, per training variant: exp(mean NLL - mean full-cache NLL) with a 95%
    bootstrap CI over (seed, stream) units (points, so that a few percent stay visible). Above 1 = worse
    than the full cache."""
    P = Policies(streams)
    r = eviction_ratios(streams).set_index(["variant", "strategy", "position_mode"])
    order = variants(r.index.get_level_values("variant"))
    arms = [tuple(a) for a in (arms or eviction_arms(streams))]
    arms = [a for a in arms if any((v, *a) in r.index for v in order)]
    fig, ax = _subplots(figsize=(0.6 * len(order) * len(arms) / 2 + 3.0, 4.6))
    x = np.arange(len(order))
    w = 0.8 / max(1, len(arms))
    for k, (name, mode) in enumerate(arms):
        a = r.reindex([(v, name, mode) for v in order])  # NaN where a variant lacks the arm
        err = [a["point"] - a["low"], a["high"] - a["point"]]
        hollow = mode == "cache"
        ax.errorbar(
            x + (k - (len(arms) - 1) / 2) * w,
            a["point"],
            yerr=err,
            color=P.color(name),
            capsize=2,
            fmt="s" if hollow else "o",
            mfc="white" if hollow else P.color(name),
            ls="none",
            label=f"{P.label(name)} ({mode})",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    _log_y(ax)
    budget = sorted(set(evicting(streams)["budget"]))
    ax.set_xticks(x)
    ax.set_xticklabels(order, rotation=40, ha="right")
    title = f"What evicting the first tokens costs (budget {', '.join(map(str, budget))})"
    return _finish(fig, ax, "training variant", "perplexity / full-cache perplexity", title)


@figure("layers", "runs", applies=_variant_trend, auto=_trend_args, per_variant=True)
def sink_trend(layers: pd.DataFrame, runs: pd.DataFrame, axes: dict, arms: list | None = None) -> Figure:
    """The sink against a scale knob, one column per knob: `axes` maps an x label to {variant: x}
    (e.g. {"training steps": {"steps200": 200, "base": 400, "steps800": 800}}). Top: attention on the
    first token (the strongest head of any layer, and the mean over heads and layers). Bottom: perplexity
    of each evicting policy in `arms` (default: all) relative to the full cache (original positions, mean
    over seeds)."""
    P = Policies(runs)
    mass = first_position_mass(layers)
    original = runs[runs["position_mode"] == "original"]
    ppl = original.groupby(["variant", "strategy"])["ppl"].mean()
    full = reference(original).groupby("variant")["ppl"].mean()
    arms = arms or P.ordered(evicting(original)["strategy"])
    fig, grid = _subplots(2, len(axes), figsize=(4.2 * len(axes), 6.4), squeeze=False, sharey="row")
    for col, (xlabel, points) in enumerate(axes.items()):
        pts = sorted((x, v) for v, x in points.items() if v in mass)
        xs = [x for x, _ in pts]
        top, bottom = grid[0][col], grid[1][col]
        top.plot(xs, [100 * mass[v].max() for _, v in pts], "o-", color="0.15", label="strongest head")
        top.plot(xs, [100 * mass[v].mean() for _, v in pts], "s--", color="0.55", label="mean over heads")
        # the axis reaches the sink threshold, so a few percent does not read as a sink
        top.axhline(100 * SINK_THRESHOLD, color="tab:red", ls=":", lw=1, label="sink head (Gu et al.: 30%)")
        top.set_ylim(0, max(100 * SINK_THRESHOLD + 5, top.get_ylim()[1]))
        for name in arms:
            ys = [ppl.get((v, name), np.nan) / full.get(v, np.nan) for _, v in pts]
            bottom.plot(xs, ys, "o-", color=P.color(name), label=P.label(name))
        bottom.axhline(1.0, color="k", lw=0.8, label="full cache")
        for ax in (top, bottom):
            if xs and min(xs) > 0:  # steps, layers: a log axis; a share that includes 0: a linear one
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}\n{v}" for x, v in pts], fontsize=8)
        bottom.set_xlabel(xlabel)
    grid[0][0].set_ylabel("% attention on position 0")
    grid[1][0].set_ylabel("perplexity / full cache")
    grid[0][0].legend(fontsize=8)
    grid[1][0].legend(fontsize=8)
    caption = subject_caption(original)
    title = "Does a sink grow with training and size, and does evicting it hurt? (mean over training seeds)"
    fig.suptitle(title + (f"\n{caption}" if caption else ""))
    fig.tight_layout()
    return fig


def trend_axes(results: pd.DataFrame, min_points: int = 3) -> dict[str, dict[str, float]]:
    """Scale knobs a variant sweep covers, for `sink_trend`: every numeric model/train setting in which at
    least min_points - 1 variants differ from `base` and in nothing else, as
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


def overlapping_tick_labels(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of tick labels of one axis that overlap when the figure renders (only the labels drawn: in
    view, non-empty). Rotated labels overlap when their anchors are closer across the text's direction
    than the text is high."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pairs = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            shown = [
                label
                for locs, labels in (
                    (axis.get_majorticklocs(), axis.get_majorticklabels()),
                    (axis.get_minorticklocs(), axis.get_minorticklabels()),
                )
                for loc, label in zip(locs, labels, strict=False)
                if low <= loc <= high and label.get_visible() and label.get_text()
            ]
            for i, a in enumerate(shown):
                for b in shown[i + 1 :]:
                    if _labels_overlap(a, b, renderer):
                        pairs.append((a.get_text(), b.get_text()))
    return pairs


def _labels_overlap(a, b, renderer) -> bool:
    box_a, box_b = a.get_window_extent(renderer), b.get_window_extent(renderer)
    angle = np.deg2rad(a.get_rotation() % 180)
    if np.isclose(np.sin(angle), 0) or np.isclose(np.cos(angle), 0):  # axis-aligned: the boxes are the text
        return box_a.shrunk(0.98, 0.98).overlaps(box_b.shrunk(0.98, 0.98))
    (xa, ya), (xb, yb) = box_a.get_points().mean(0), box_b.get_points().mean(0)
    across = abs((xb - xa) * np.sin(angle) - (yb - ya) * np.cos(angle))  # distance across the text direction
    return across < 0.9 * a.get_fontsize() * fig_dpi(a) / 72


def fig_dpi(artist) -> float:
    return artist.figure.dpi


def one_variant(tables: Tables) -> Tables:
    """The tables restricted to the first training variant (base), for figures that compare policies."""
    if not _many_variants(tables):
        return tables
    first = variants(tables["streams"]["variant"])[0]
    return {k: t[t["variant"] == first] if "variant" in t else t for k, t in tables.items()}


def draw(name: str, tables: Tables, **args) -> Figure:
    """Figure `name` of the registry from a sweep's tables (with "runs"), with the given arguments."""
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
    spec = FIGURES[name]
    return spec.draw(tables if spec.per_variant else one_variant(tables), **args)


def draw_all(tables: Tables) -> dict[str, Figure]:
    """Every figure the tables support, with automatic arguments (the sweep report)."""
    figs = {}
    for name, spec in FIGURES.items():
        t = tables if spec.per_variant else one_variant(tables)
        if not t["streams"].empty and spec.applies(t):
            figs[name] = spec.draw(t, **spec.auto(t))
    return figs
