"""The sweep report: every figure the aggregated tables support, and a self-contained HTML page.

    python -m evictlab.report outputs/runs/default [--out outputs/figures/default] [--report PATH]

Reads the tables `python -m evictlab.aggregate` wrote into the sweep folder (it does not aggregate again),
draws the figures of the registry in analysis/figures.py, writes PNG + PDF files and the HTML report,
and mirrors figures and headline table to W&B with the sweep's own logger settings.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from evictlab import results as R
from evictlab.analysis import figures as F
from evictlab.analysis import stats as S
from evictlab.analysis.aggregate import check_folders, run_dirs, subject_lines, wide
from evictlab.store import git_info, outputs_dir, write_atomic

# a perplexity CI over fewer independent units (seed x stream) than this is flagged (*) in the report
MIN_UNITS = 8
# the small GPT's shape fields, which an imported checkpoint (model.name_or_path) replaces with its own
IMPORTED_SHAPE = tuple(
    "n_layer n_head n_kv_head n_embd mlp_ratio mlp_hidden pos_emb rope_base block_size norm norm_eps act "
    "bias qkv_bias rotary_dim parallel_residual init_std vocab_size".split()
)


def load_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """A sweep folder's (or snapshot's) aggregated tables, plus `runs` (one row per run) and failures."""
    tables = R.read_tables(folder)
    tables["runs"] = wide(tables["results"])
    failures = folder / R.FAILURES
    tables["failures"] = (
        pd.read_csv(failures) if failures.exists() else pd.DataFrame(columns=R.FAILURE_COLUMNS)
    )
    return tables


def headline_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per policy x budget x mode: perplexity with 95% CI, KL, agreement, KV KiB."""
    streams, runs = tables["streams"], tables["runs"]
    P = S.PolicyOrder(streams)
    prefix = [c for c in ("model", "dataset", "variant") if c in streams and streams[c].nunique() > 1]
    setting = []  # runs of one strategy with different parameters (or conf/arm/ arms) get their own rows
    if "results" in tables and not tables["results"].empty:
        labels = S.setting_labels(tables["results"])
        if (labels != "").any():
            streams = streams.assign(setting=streams["run_key"].map(labels).fillna(""))
            runs = runs.assign(setting=runs["run_key"].map(labels).fillna(""))
            setting = ["setting"]
    keys = [*prefix, "strategy", *setting, "budget", "position_mode"]
    ppl = S.summarize_streams(streams, "nll", np.exp, keys)
    ppl["perplexity [95% CI]"] = [
        f"{p:.3f} [{lo:.3f}, {hi:.3f}]{' *' if n < MIN_UNITS else ''}"
        for p, lo, hi, n in ppl[["point", "low", "high", "n"]].values
    ]
    extra = runs.groupby(keys, as_index=False)[[c for c in ("kl_mean", "agreement", "kv_bytes") if c in runs]]
    trainings = ["clusters"] if (ppl["clusters"] > 1).any() else []  # hierarchical CIs: say over how many
    t = ppl[[*keys, "perplexity [95% CI]", "n", *trainings]].merge(extra.mean(), on=keys, how="left")
    t["kv_KiB"] = t.pop("kv_bytes") / 1024
    t["order"] = t["strategy"].map(P.order)
    t = t.sort_values([*prefix, "position_mode", "order", *setting, "budget"]).drop(columns="order")
    t["strategy"] = t["strategy"].map(P.label)
    for col, fmt in (("kl_mean", "{:.4f}"), ("agreement", "{:.3f}"), ("kv_KiB", "{:,.0f}")):
        if col in t:  # fixed decimals: the full cache's KL reads 0.0000, not 6.022e-09 (nor -0.0000)
            t[col] = [fixed(fmt, v) for v in t[col]]
    t["budget"] = t["budget"].astype(int)
    return t.rename(columns={"n": "units (seed x stream)", "clusters": "training runs"})


def fixed(fmt: str, v: float) -> str:
    """v in a fixed-decimal format, "-" when missing, without the sign of a value that rounds to zero (the
    full cache's KL against its reference is -6e-9 on one machine, +6e-9 on another)."""
    if pd.isna(v):
        return "-"
    text = fmt.format(v)
    return text[1:] if text.startswith("-") and float(text.replace(",", "")) == 0 else text


def _interval(point: float, low: float, high: float) -> str:
    return f"{point:.3f} [{low:.3f}, {high:.3f}]"


def _policy_grid(frame: pd.DataFrame, P: S.PolicyOrder, column: str) -> pd.DataFrame:
    """Rows of (strategy, `policy` label, `column`, `cell`) as a table: one row per policy in figure
    order, one column per value of `column` (budgets as "b64"), "-" where a policy has no cell."""
    t = frame.assign(order=frame["strategy"].map(lambda n: P.order.get(n, 100)))
    t = t.pivot_table(index=["order", "policy"], columns=column, values="cell", aggfunc="first")
    if column == "budget":
        t.columns = [f"b{int(b)}" for b in t.columns]
    t = t.iloc[sorted(range(len(t)), key=lambda i: (t.index[i][0], _natural(t.index[i][1])))]
    return t.droplevel("order").fillna("-")


def _natural(label: str) -> list:
    """A sort key that orders the numbers inside a label by value ("n_sink=2" before "n_sink=16")."""
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"(\d+)", label)]


def cost_table(tables: dict[str, pd.DataFrame], mode: str = "original") -> pd.DataFrame:
    """Per policy (rows, figure order; `policy (setting)` where runs of one policy differ, as
    `training_table` names them) x budget (columns): "perplexity (perplexity / full-cache perplexity [95%
    CI])" in one position mode, the cost paired stream by stream against the full cache as in the
    `cost_vs_budget` figure, its CI hierarchical (training run, then stream) where the policy's runs span
    several checkpoints. The numbers an experiment README quotes: `make tables EXP=NAME` prints them."""
    streams = tables["streams"]
    P = S.PolicyOrder(streams)
    s = S.evicting(streams[streams["position_mode"] == mode]).assign(delta=S.paired_delta)
    s = s.assign(policy=_row_names(s, tables))
    keys = ["strategy", "policy", "budget"]
    ppl = S.summarize_streams(s, "nll", np.exp, keys)
    cost = S.summarize_streams(s, "delta", np.exp, keys)
    cost["cell"] = [
        f"{p:.2f} ({_interval(c, lo, hi)})"
        for p, c, lo, hi in zip(ppl["point"], cost["point"], cost["low"], cost["high"], strict=True)
    ]
    return _policy_grid(cost, P, "budget")


def _row_names(s: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> pd.Series:
    """Per row: its policy's label, "label (setting)" where runs of one policy differ (`S.split_settings`)."""
    f = S.split_settings(s, tables.get("results"))
    return f["strategy_label"] if "strategy_label" in f else f["strategy"]


def training_table(
    tables: dict[str, pd.DataFrame], mode: str = "original", budget: int | None = None, against: str = ""
) -> pd.DataFrame:
    """Per policy or arm (rows; a policy's runs with different parameters or conf/arm/ arms apart, the full
    cache's ablations included) x training run (columns, named by `stats.training_labels`): perplexity /
    full-cache perplexity with a 95% paired CI over that training's streams, and in the last column over
    all trainings with the hierarchical CI (training, then stream). `budget`: only the evicting runs of
    that budget. `against` (a row's name, e.g. "window"): that row's perplexity / each other evicting
    row's instead, paired per stream (above 1: the row does better); a run that scored sampled steps only
    (`stats.sampled_runs`) is set against it through the full cache: exp(mean over streams of the row's
    cost against the full cache minus the sampled run's, each on its own predictions). For a group whose
    trainings are one recipe's seeds: does a result hold in each?"""
    streams = tables["streams"]
    s = streams[(streams["position_mode"] == mode) & ~S.is_reference(streams)]
    if budget is not None:
        s = s[~s["evicts"].astype(bool) | (s["budget"] == budget)]
    P = S.PolicyOrder(streams)
    trained = S.training_labels(tables["results"])
    s = s.assign(delta=S.paired_delta, row=_row_names(s, tables))
    s["training"] = s["checkpoint"].map(trained).fillna(s["checkpoint"])
    if against:
        units = [c for c in (S.CLUSTER, "seed", "stream") if c in s]
        base = s[s["row"] == against].set_index(units)
        if base.empty:
            raise ValueError(f"no row {against!r} to compare against; rows: {sorted(s['row'].unique())}")
        s = s[(s["row"] != against) & s["evicts"].astype(bool)]  # policies against policies
        at = pd.MultiIndex.from_frame(s[units])
        plain = base["nll"].reindex(at).to_numpy() - s["nll"].to_numpy()
        through_full = base["delta"].reindex(at).to_numpy() - s["delta"].to_numpy()
        sampled = s["run_key"].isin(S.sampled_runs(tables.get("results"))).to_numpy()
        s["delta"] = np.where(sampled, through_full, plain)
        s = s.dropna(subset=["delta"])
    rows = []
    for (name, label), g in s.groupby(["strategy", "row"]):
        row = {"order": P.order.get(name, 100), "policy": label}
        for training, t in g.groupby("training"):
            row[training] = _interval(*np.exp(S.bootstrap_ci(t["delta"].to_numpy())))
        n = g["training"].nunique()
        if n > 1:
            row[f"{n} trainings"] = _interval(
                *np.exp(S.nested_bootstrap_ci(g["delta"].to_numpy(), g["checkpoint"].to_numpy()))
            )
        rows.append(row)
    t = pd.DataFrame(rows).sort_values(["order", "policy"]).drop(columns="order").set_index("policy")
    return t.fillna("-")


def _bands(c: pd.DataFrame, edges: list[int]) -> tuple[pd.Series, list[str]]:
    """Each curve row's position band (cut at `edges` by its bucket's first position) and the bands'
    labels with their true edges: the first and last position the buckets in each band hold (a log-spaced
    bucket that starts before an edge runs past it)."""
    start = c["position_start"].astype(float)
    end = np.round(start + S.bucket_width(c)).astype(int) - 1  # the bucket's last position
    cut = pd.cut(start, [0, *edges, np.inf], right=False, labels=False)
    labels = {}
    for b in sorted(cut.dropna().unique()):
        held = cut == b
        labels[int(b)] = f"{int(start[held].min()):,} - {int(end[held].max()):,}"
    return cut.map(labels), list(labels.values())


def _weights(c: pd.DataFrame, column: str = "n") -> pd.Series:
    """Predictions per curve row: its `column` count where aggregation recorded it, else its bucket's
    width (tables from before the counts)."""
    return c[column].astype(float) if column in c else S.bucket_width(c)


def band_table(tables: dict[str, pd.DataFrame], edges: list[int]) -> pd.DataFrame:
    """Per run setting (policy, budget, position mode): perplexity over the whole stream (mean over its
    streams' NLL) and the mean NLL [nats] in position bands cut at `edges` (e.g. the training context and
    a later point), labelled with their true edges (`_bands`), each bucket weighted by the predictions it
    holds (the full cache's by those its capped reference covers), all streams pooled: where along a long
    stream a policy holds or fails. Costs against the full cache: `band_cost_table` (paired). Runs of one
    policy that differ in a setting (n_sink) are rows of their own (`stats.split_settings`)."""
    results = tables.get("results")
    c, streams = S.split_settings(tables["curves"], results), S.split_settings(tables["streams"], results)
    from_runs = False
    if not S.is_reference(streams).any() and "nll_full" in c and c["nll_full"].notna().any():
        c, streams = _reference_from_runs(c, streams, results)
        from_runs = True
    band, names = _bands(c, edges)
    c = c.assign(_w=_weights(c), band=band)
    c = c.assign(_x=c["nll"] * c["_w"])
    keys = ["strategy", "budget", "position_mode"]
    nll = c.groupby([*keys, "band"], observed=True)[["_x", "_w"]].sum()
    nll = (nll["_x"] / nll["_w"]).unstack("band")
    ppl = streams.groupby(keys)["nll"].mean().map(np.exp).rename("perplexity")
    t = pd.concat([ppl, nll], axis=1).reset_index()
    P = S.PolicyOrder(streams)
    t["order"] = t["strategy"].map(P.order)
    t["_mode"] = t["position_mode"].map({"original": 0, "cache": 1})
    t = t.sort_values(["order", "budget", "_mode"])
    same = t.groupby(["strategy", "budget"])["perplexity"].transform(
        lambda p: p.nunique() == 1 and len(p) > 1
    )
    t.loc[same, "position_mode"] = "both"  # the full cache and a window: the same computation in both modes
    t = t.drop_duplicates(["strategy", "budget", "position_mode"])
    ref = t["strategy"].map(P.is_reference)
    t["budget"] = ["-" if r else f"{int(b):,}" for r, b in zip(ref, t["budget"], strict=True)]
    t["policy"] = t["strategy"].map(P.label)
    if from_runs:  # the runs' reference: one computation whatever their position mode
        t.loc[ref, "position_mode"] = "both"
    cols = ["policy", "budget", "position_mode", "perplexity", *[n for n in names if n in t]]
    out = t[cols].rename(columns={"position_mode": "mode"}).set_index("policy")
    for col in out.columns[3:]:
        out[col] = [f"{v:.3f}" if pd.notna(v) else "-" for v in out[col]]
    out["perplexity"] = [
        f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}" for v in out["perplexity"]
    ]
    return out


def band_cost_table(
    tables: dict[str, pd.DataFrame], edges: list[int], against: str | None = None
) -> pd.DataFrame:
    """Per evicting policy, budget and mode (rows) x position band (`_bands`, true edges): the paired cost
    against the full cache on the same predictions, exp(mean over streams of the stream's NLL difference
    over the band's predictions that the full-cache reference covers), with its 95% CI over the streams
    (`stats.summarize_streams`: Student's t below MIN_BOOTSTRAP_UNITS streams); "-" where the reference
    covers none of the band. Cells "ratio [low, high]"; `n`: the streams. A sampled run
    (eval.recompute_sample) is paired on its sampled predictions (its `nll_full` holds the reference there
    only); runs of one policy that differ in a setting (n_sink) are rows of their own
    (`stats.split_settings`).

    `against` (a row's name or label, e.g. "StreamingLLM"): that policy set against each other row of its
    budget and mode instead, exp(mean over streams of (its band difference to the full cache - the
    row's)): its perplexity / the row's, above 1 where the row does better. Where both cover the same
    predictions the full cache cancels and this is their plain paired difference; against a sampled run
    it is a difference of differences, each paired with the full cache on its own predictions of that
    band and stream (the full cache as control for how hard the sampled predictions are), the sampling
    error in the CI."""
    results = tables.get("results")
    c = S.evicting(S.split_settings(tables["curves"], results))
    c = c[c["nll_full"].notna()]  # the predictions the reference covers: the bands' edges are theirs
    band, names = _bands(c, edges)
    if "nll_paired" in c:
        nll, w = c["nll_paired"], _weights(c, "n_paired")
    else:  # tables from before the paired columns: the bucket's NLL (its reference has a value: above)
        nll, w = c["nll"], _weights(c)
    c = c.assign(band=band, _w=w, _x=(nll - c["nll_full"]) * w)
    keys = ["strategy", "budget", "position_mode"]
    per = c.groupby([*keys, "stream", "band"], observed=True)[["_x", "_w"]].sum()
    per = per[per["_w"] > 0].assign(delta=lambda f: f["_x"] / f["_w"]).reset_index()
    P = S.PolicyOrder(c)  # (the split rows: each setting's label and order)
    if against is not None:
        named = [n for n in per["strategy"].unique() if against in (n, P.label(n))]
        if not named:
            rows = sorted(P.label(n) for n in per["strategy"].unique())
            raise ValueError(f"no row {against!r} to compare against; rows: {rows}")
        per = _against(per, named[0], keys)
    r = S.summarize_streams(per, "delta", np.exp, keys=(*keys, "band"))
    r["cell"] = [_interval(*v) for v in r[["point", "low", "high"]].to_numpy()]
    r["order"] = r["strategy"].map(P.order)
    rows = ["order", "strategy", "budget", "position_mode", "n"]
    t = r.pivot_table(index=rows, columns="band", values="cell", aggfunc="first").reset_index()
    t = t.sort_values(["order", "budget", "position_mode"]).assign(
        policy=lambda f: f["strategy"].map(P.label)
    )
    t["budget"] = [f"{int(b):,}" for b in t["budget"]]
    cols = ["policy", "budget", "position_mode", "n", *[n for n in names if n in t]]
    return t[cols].rename(columns={"position_mode": "mode"}).set_index("policy").fillna("-")


def _against(per: pd.DataFrame, against: str, keys: list[str]) -> pd.DataFrame:
    """Per-stream band deltas (`band_cost_table`) -> the `against` policy's delta minus each other row's
    of the same budget, mode, stream and band (rows that lack a counterpart are dropped)."""
    units = ["budget", "position_mode", "stream", "band"]
    base = per[per["strategy"] == against]
    other = per[per["strategy"] != against].merge(base[[*units, "delta"]], on=units, suffixes=("", "_base"))
    return other.assign(delta=other["delta_base"] - other["delta"]).drop(columns="delta_base")


def held_table(tables: dict[str, pd.DataFrame], mode: str = "original") -> pd.DataFrame | None:
    """Per evicting policy (rows) x budget: the share of steps at which the cache holds position 0 under the
    policy (layers.parquet `held_p0`), as "mean over layers (lowest layer)", e.g. "0.984 (0.295)"; None
    for runs from before it was recorded."""
    layers = tables.get("layers")
    if layers is None or layers.empty or "held_p0" not in set(layers["metric"]):
        return None
    held = layers[(layers["metric"] == "held_p0") & (layers["position_mode"] == mode)]
    held = S.evicting(held) if "evicts" in held else held
    P = S.PolicyOrder(tables["streams"])
    held = held.assign(policy=_row_names(held, tables))  # runs of one policy that differ: apart
    g = held.groupby(["strategy", "policy", "budget"])["value"].agg(["mean", "min"]).reset_index()
    g["cell"] = [f"{m:.3f} ({lo:.3f})" for m, lo in zip(g["mean"], g["min"], strict=True)]
    return _policy_grid(g, P, "budget")


def sinks_table(tables: dict[str, pd.DataFrame], against: int = 1) -> pd.DataFrame:
    """StreamingLLM's initial-token table, paired: per number of kept initial positions (rows, n_sink) and
    arm (columns: the stream starts with BOS or not, x position mode), the perplexity ratio against the
    same arm keeping `against` positions on the same streams, exp(mean per-stream NLL difference) with its
    95% CI (`stats.summarize_streams`), and on how many streams it is lower: "0.974 [0.960, 0.987];
    13/16". The arms are never pooled (their streams differ by the BOS token)."""
    settings = S.run_settings(
        tables["results"], {"cfg.strategy.params.n_sink": "n_sink", "cfg.dataset.bos": "bos"}
    )
    s = S.evicting(tables["streams"]).join(settings, on="run_key")
    keys = ["bos", "position_mode", "stream"]
    ref = s[s["n_sink"] == against][[*keys, "nll"]].rename(columns={"nll": "nll_ref"})
    s = s.merge(ref, on=keys).assign(delta=lambda f: f["nll"] - f["nll_ref"])
    s = s.drop(columns=S.CLUSTER, errors="ignore")  # one model: the arms are settings, not trainings
    r = S.summarize_streams(s, "delta", np.exp, keys=("bos", "position_mode", "n_sink"))
    lower = s.groupby(["bos", "position_mode", "n_sink"])["delta"].agg(lambda d: int((d < 0).sum()))
    r["cell"] = [
        f"{_interval(p, lo, hi)}; {lower[b, m, k]}/{n}"
        for p, lo, hi, b, m, k, n in r[
            ["point", "low", "high", "bos", "position_mode", "n_sink", "n"]
        ].to_numpy()
    ]
    r["arm"] = [f"{'BOS' if b else 'no BOS'}, {m}" for b, m in zip(r["bos"], r["position_mode"], strict=True)]
    t = r.pivot_table(index="n_sink", columns="arm", values="cell", aggfunc="first")
    t.index = [int(k) for k in t.index]
    return t.rename_axis(f"n_sink (against {against})")


def _reference_from_runs(curves: pd.DataFrame, streams: pd.DataFrame, results: pd.DataFrame | None):
    """A sweep without a full-cache run (its streams outrun the reference's cap): the full cache's rows from
    the reference every run carries (`nll_full`, over the predictions the cap covers), taken from the first
    policy's runs at one budget and mode, as `nll_vs_position` draws it. -> curves, streams with the rows
    added under the strategy name S.RUNS_REFERENCE, labelled with how far the reference goes."""
    P = S.PolicyOrder(streams)
    first = P.ordered(streams["strategy"])[0]
    one = streams[streams["strategy"] == first]
    one = one[(one["budget"] == one["budget"].min()) & (one["position_mode"] == one["position_mode"].iloc[0])]
    keys = ["budget", "position_mode", "strategy"]
    pick = curves.merge(one[keys].drop_duplicates(), on=keys)
    cap = "cfg.eval.full_max_len"
    if results is not None and cap in results and results[cap].notna().any():
        label = f"full cache (reference, first {int(results[cap].min()):,} predictions)"
    else:
        label = "full cache (reference)"
    facts = {"strategy": S.RUNS_REFERENCE, "strategy_label": label, "strategy_order": -1, "evicts": False}
    ref_c = pick.dropna(subset=["nll_full"]).assign(nll=lambda f: f["nll_full"], **facts)
    if "n_paired" in ref_c:  # a bucket counts the predictions the reference covers
        ref_c = ref_c.assign(n=ref_c["n_paired"])
    ref_s = one.assign(nll=one["nll_full"], **facts)
    return pd.concat([curves, ref_c], ignore_index=True), pd.concat([streams, ref_s], ignore_index=True)


def mode_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per evicting policy (rows) x budget: the paired perplexity ratio cache / original positions with its
    95% CI (`stats.mode_ratios`), as the `position_modes` figure draws it."""
    streams = tables["streams"]
    r = S.mode_ratios(streams)
    P = S.PolicyOrder(streams)
    r["cell"] = [_interval(*v) for v in r[["point", "low", "high"]].to_numpy()]
    return _policy_grid(r.assign(policy=r["strategy"].map(P.label)), P, "budget")


def recall_table(tables: dict[str, pd.DataFrame], mode: str = "original") -> pd.DataFrame:
    """Per policy (rows) x budget: pass-key answers recalled exactly, teacher-forced (for a causal policy
    the same as greedy decoding, tests/test_recall.py), as "recalled/streams (per needle depth, shallow to
    deep)", e.g. "9/20 (0/0/2/3/4)"."""
    r = tables["recall"]
    r = r[r["position_mode"] == mode]
    P = S.PolicyOrder(r)
    rows = []
    for (name, budget), g in r.groupby(["strategy", "budget"]):
        by_depth = g.groupby("depth")["exact_teacher_forced"].sum().astype(int)
        cell = f"{int(g['exact_teacher_forced'].sum())}/{len(g)} ({'/'.join(map(str, by_depth))})"
        label = "all" if P.is_reference(name) else f"b{int(budget)}"
        rows.append({"strategy": name, "policy": P.label(name), "column": label, "cell": cell})
    t = _policy_grid(pd.DataFrame(rows), P, "column")
    budgets = sorted((c for c in t.columns if c != "all"), key=lambda c: int(c[1:]))
    return t[[c for c in ("all", *budgets) if c in t.columns]]


def task_table(
    tables: dict[str, pd.DataFrame], mode: str = "original", column: str = "exact"
) -> pd.DataFrame:
    """Per task and context (row groups: "task, T tokens") and policy (rows) x budget: the share of answers
    graded correct (`column`: `exact`, as written under the policy; `exact_teacher_forced`, which the
    oracle has too) as "share [95% Wilson CI] k/n", and against the full cache's answers to the same
    samples the exact McNemar p-value ("p=0.031"). The full cache's cells sit in the "all" column."""
    t = tables["tasks"]
    t = t[(t["position_mode"] == mode) & t[column].notna()]
    P = S.PolicyOrder(t)
    rows = []
    for (task, T), g in t.groupby(["task", "stream_len"]):
        full = g[S.is_reference(g)].set_index("stream")[column].astype(bool)
        for (name, budget), r in g.groupby(["strategy", "budget"]):
            ok = r.set_index("stream")[column].astype(bool)
            p, lo, hi = S.wilson_ci(int(ok.sum()), len(ok))
            cell = f"{p:.2f} [{lo:.2f}, {hi:.2f}] {int(ok.sum())}/{len(ok)}"
            if not P.is_reference(name) and len(full):
                both = full.index.intersection(ok.index)
                p_value = S.mcnemar_p(ok[both].to_numpy(), full[both].to_numpy())
                cell += "; p<0.001" if p_value < 0.001 else f"; p={p_value:.3f}"
            label = "all" if P.is_reference(name) else f"b{int(budget)}"
            row = f"{task}, {int(T):,} tokens: {P.label(name)}"
            rows.append({"strategy": name, "policy": row, "column": label, "cell": cell})
    if not rows:
        return pd.DataFrame()
    grid = _policy_grid(pd.DataFrame(rows), P, "column")
    grid = grid.iloc[sorted(range(len(grid)), key=lambda i: _natural(grid.index[i].split(":")[0]))]
    budgets = sorted((c for c in grid.columns if c != "all"), key=lambda c: int(c[1:]))
    return grid[[c for c in ("all", *budgets) if c in grid.columns]]


def generation_table(tables: dict[str, pd.DataFrame], mode: str = "original") -> pd.DataFrame:
    """Per evicting policy (rows) x budget: its greedy continuations against the full cache's from the same
    prefix (the generations table, one row per stream): "ROUGE-L [95% CI]; tokens to the first divergence
    [95% CI]; identical k/n" (CIs over streams: a bootstrap from MIN_BOOTSTRAP_UNITS streams on, else t)."""
    g = tables.get("generations", pd.DataFrame())
    if g.empty:
        return pd.DataFrame()
    P = S.PolicyOrder(g)
    g = S.evicting(g[g["position_mode"] == mode])  # (the full cache against itself: identical)
    n_new = tables["runs"]["generate_tokens"].max()  # first_divergence is n_new where nothing differs
    rows = []
    for (name, budget), r in g.groupby(["strategy", "budget"]):
        (rl, rl_lo, rl_hi), _ = S.mean_ci(r["rouge_l"].to_numpy(float))
        (fd, fd_lo, fd_hi), _ = S.mean_ci(r["first_divergence"].to_numpy(float))
        same = int((r["first_divergence"] >= n_new).sum())
        cell = f"{rl:.2f} [{rl_lo:.2f}, {rl_hi:.2f}]; {fd:.1f} [{fd_lo:.1f}, {fd_hi:.1f}]; {same}/{len(r)}"
        rows.append({"strategy": name, "policy": P.label(name), "column": f"b{int(budget)}", "cell": cell})
    grid = _policy_grid(pd.DataFrame(rows), P, "column")
    return grid[sorted(grid.columns, key=lambda c: int(c[1:]))]


def decode_table(tables: dict[str, pd.DataFrame], mode: str = "original") -> pd.DataFrame:
    """Per policy (rows) x budget: how fast its runs wrote their answers, "explicit token-steps/s" and, for
    a policy that reads no attention weights, "; SDPA x.x (same k%)": the same decode steps through the
    fused kernel and the share of answers it wrote identically (the price of needing the weights is the
    gap H2O and TOVA cannot close). Means over the runs of a cell; empty without decode measurements."""
    runs = tables["runs"]
    if "decode_token_steps_per_s" not in runs:
        return pd.DataFrame()
    r = runs[(runs["position_mode"] == mode) & runs["decode_token_steps_per_s"].notna()]
    P = S.PolicyOrder(r)
    rows = []
    for (name, budget), g in r.groupby(["strategy", "budget"]):
        cell = f"{g['decode_token_steps_per_s'].mean():.1f}"
        if "decode_token_steps_per_s_fused" in g and g["decode_token_steps_per_s_fused"].notna().any():
            same = 100 * g["fused_same_tokens"].mean()
            cell += f"; SDPA {g['decode_token_steps_per_s_fused'].mean():.1f} (same {same:.0f}%)"
        label = "all" if P.is_reference(name) else f"b{int(budget)}"
        rows.append({"strategy": name, "policy": P.label(name), "column": label, "cell": cell})
    if not rows:
        return pd.DataFrame()
    grid = _policy_grid(pd.DataFrame(rows), P, "column")
    budgets = sorted((c for c in grid.columns if c != "all"), key=lambda c: int(c[1:]))
    return grid[[c for c in ("all", *budgets) if c in grid.columns]]


def units_line(tables: dict[str, pd.DataFrame]) -> str:
    """What every CI of a group rests on: trainings, streams per training, the full cache's perplexity."""
    streams = tables["streams"]
    full = S.reference(streams)
    n_ck = streams[S.CLUSTER].nunique() if S.CLUSTER in streams else 1
    per = streams.groupby("run_key").size().max()  # streams per run (a run belongs to one training)
    # the point of summarize_streams: the mean over trainings of each training's mean (no CI needed here)
    means = full.groupby(S.CLUSTER)["nll"].mean() if S.CLUSTER in full else full["nll"]
    ppl = float(np.exp(means.mean())) if len(full) else None
    what = f"{n_ck} training run(s) x {per} stream(s)" if n_ck > 1 else f"{per} stream(s)"
    if n_ck == 1:  # the method summarize_streams takes at this n
        what += " (Student's t)" if per < S.MIN_BOOTSTRAP_UNITS else " (bootstrap)"
    return f"CIs over {what}; full-cache perplexity {ppl:.3f}" if ppl else f"CIs over {what}"


def shared_settings(results: pd.DataFrame) -> pd.Series:
    """The config values every run of the sweep shares and uses: a setting some runs lack (one policy's
    parameter) or that none uses (a BPE vocabulary size under the byte tokenizer; the small GPT's shape
    fields when the model is imported from a checkpoint, which brings its own) is left out."""
    runs = results.drop_duplicates("run_dir" if "run_dir" in results else "run_key")
    cols = [c for c in runs if c.startswith("cfg.")]
    shared = [c for c in cols if runs[c].notna().all() and runs[c].astype(str).nunique() == 1]
    row = runs.iloc[0]
    unused = set()
    if row.get("cfg.tokenizer.kind") != "bpe":
        unused.add("cfg.tokenizer.vocab_size")
    if isinstance(row.get("cfg.model.name_or_path"), str):
        unused |= {f"cfg.model.{k}" for k in IMPORTED_SHAPE}
    return row[[c for c in shared if c not in unused]]


def _ci(a) -> str:
    return "-" if a is None else f"{a['point']:.3f} [{a['low']:.3f}, {a['high']:.3f}]"


def variant_table(tables: dict[str, pd.DataFrame], arms: list | None = None) -> pd.DataFrame:
    """Per training variant: the model's validation bits per byte, its attention on the first token (the
    strongest head, and the mean over heads and layers), full-cache perplexity, each eviction arm's
    perplexity relative to the full cache, and the paired NLL difference of the first two evicting
    policies (in figure order; window - StreamingLLM in sink_emergence), original positions, with 95%
    bootstrap CIs over (seed, stream) units."""
    runs, streams = tables["runs"], tables["streams"]
    P = S.PolicyOrder(streams)
    mass = S.first_position_mass(tables["layers"])
    ratios = S.eviction_ratios(streams).set_index(["variant", "strategy", "position_mode"])
    arms = [tuple(a) for a in (arms or S.eviction_arms(streams))]
    original = streams[streams["position_mode"] == "original"]
    pair = P.ordered(S.evicting(original)["strategy"])[:2]
    rows = []
    for v in S.variants(mass):
        full = S.reference(runs[(runs["variant"] == v) & (runs["position_mode"] == "original")])
        strongest = mass[v].max(axis=1)
        row = {
            "variant": v,
            "val bits/byte": full["checkpoint_val_bpb"].iloc[0],
            "strongest head on pos 0 [%]": f"{100 * strongest.max():.1f} (L{int(strongest.argmax())})",
            "mean on pos 0 [%]": 100 * mass[v].mean(),
            "full-cache ppl": full["ppl"].mean(),
        }
        for name, mode in arms:
            a = ratios.loc[(v, name, mode)] if (v, name, mode) in ratios.index else None
            row[f"{P.label(name)} ({mode}) / full"] = _ci(a)
        if len(pair) == 2:
            mine = original[original["variant"] == v]
            nll = [mine[mine["strategy"] == n].set_index(["seed", "stream"])["nll"] for n in pair]
            paired = (nll[0] - nll[1]).dropna().to_numpy()
            title = f"{P.label(pair[0])} - {P.label(pair[1])} NLL"
            row[title] = (
                "-" if not len(paired) else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*S.bootstrap_ci(paired))
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _png_b64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return base64.b64encode(buf.getvalue()).decode()


def write_report(path: Path, tables: dict[str, pd.DataFrame], figs: dict[str, Figure], title: str) -> None:
    g, failures = git_info(), tables["failures"]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
        "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}.warning{color:#b00}"
        "</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M')} from commit <code>{g['commit']}</code>"
        f"{' (dirty)' if g['dirty'] else ''}. Runs: {tables['results']['run_key'].nunique()} ok, "
        f"{len(failures)} failed or unfinished.</p>",
    ]
    items = [
        f"<li class='warning'>{html.escape(line)}</li>"
        if line.startswith("warning")
        else f"<li>{html.escape(line)}</li>"
        for line in subject_lines(tables["results"])
    ]
    parts.append("<h2>Models and datasets</h2><ul>" + "".join(items) + "</ul>")
    if len(failures):
        parts.append("<h2>Failed or unfinished runs</h2>" + failures.to_html(index=False))
    head = headline_table(tables)
    parts.append("<h2>Headline numbers</h2>" + head.to_html(index=False, float_format="%.4g"))
    parts.append(
        "<p>Perplexity CIs: 95% bootstrap over the independent units counted in "
        "<code>units (seed x stream)</code>"
        + (
            f"; <span class='warning'>* fewer than {MIN_UNITS} units: too few for a reliable interval"
            "</span>.</p>"
            if (head["units (seed x stream)"] < MIN_UNITS).any()
            else ".</p>"
        )
    )
    if "variant" in tables["streams"] and tables["streams"]["variant"].nunique() > 1:
        variant = variant_table(tables).to_html(index=False, float_format="%.3f")
        parts.append("<h2>Training variants</h2>" + variant)
    for name, fig in figs.items():
        img = f"<img alt='{name}' src='data:image/png;base64,{_png_b64(fig)}'>"
        parts.append(f"<h2 id='{name}'>{name.replace('_', ' ')}</h2>{img}")
    common = shared_settings(tables["results"]).sort_index()
    if len(common):
        parts.append("<h2>Configuration shared by every run</h2>" + common.to_frame("value").to_html())
    parts.append("</body></html>")
    text = "\n".join(parts)
    write_atomic(path, lambda p: p.write_text(text))


def _log_to_wandb(sweep: Path, tables, out: Path, figs: dict[str, Figure]) -> None:
    """Mirror the figures and the headline table to W&B with the sweep's own logger settings (from a run's
    config.yaml; a sweep without runs logs nothing)."""
    from evictlab.logger import LoggerConfig, LoggerMode
    from evictlab.tracking import log_report

    dirs = run_dirs([sweep])
    cfg = yaml.safe_load((dirs[0] / R.CONFIG).read_text()) if dirs else {}
    logger = LoggerConfig.from_dict(cfg.get("logger") or {"mode": LoggerMode.disabled})
    outputs = Path((cfg.get("paths") or {}).get("outputs") or outputs_dir())
    log_report(
        logger, outputs, sweep.name, {stem: out / f"{stem}.png" for stem in figs}, headline_table(tables)
    )


def group_of(sweep: Path) -> str:
    """The group a sweep folder holds: its path under a `runs/` folder (`a/b` for group=a/b), else its name.
    Each group's figures and report get their own folder, so reporting one never overwrites another's."""
    parts = sweep.resolve().parts
    if "runs" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("runs")
        return "/".join(parts[at + 1 :])
    return sweep.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "sweep", type=Path, help="a sweep folder (outputs/runs/<group>) that aggregate has written"
    )
    ap.add_argument("--out", type=Path, default=None, help="figure folder (default outputs/figures/<group>)")
    ap.add_argument(
        "--report", type=Path, default=None, help="HTML report (default outputs/report/<group>/index.html)"
    )
    ap.add_argument("--no-wandb", action="store_true", help="do not log the figures and table to W&B")
    args = ap.parse_args(argv)
    if not check_folders([args.sweep]):
        return 2
    if not R.table_path(args.sweep, "results").exists():
        hint = f"run `python -m evictlab.aggregate {args.sweep}` first"
        print(f"error: {args.sweep} has no aggregated results: {hint}", file=sys.stderr)
        return 2
    tables = load_tables(args.sweep)
    if tables["results"].empty:
        print(f"error: no finished runs under {args.sweep}", file=sys.stderr)
        return 2
    group = group_of(args.sweep)
    out = args.out or outputs_dir() / "figures" / group
    out.mkdir(parents=True, exist_ok=True)
    report = args.report or outputs_dir() / "report" / group / "index.html"
    with F.style():  # drawn and saved in evictlab's style; matplotlib's settings are untouched after
        figs = F.draw_all(tables)
        for stem, fig in figs.items():
            for ext in ("png", "pdf"):
                fig.savefig(out / f"{stem}.{ext}", dpi=150)
        write_report(report, tables, figs, f"evictlab: {group}")
    if not args.no_wandb:
        _log_to_wandb(args.sweep, tables, out, figs)
    print(f"{len(figs)} figures -> {out}; report -> {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
