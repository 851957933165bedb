"""The statistics the report's tables and the figures share: numpy and pandas only (no matplotlib), so
they are tested and used without drawing. Confidence intervals: 95%, over independent units (seed x
stream, or documents): a bootstrap from MIN_BOOTSTRAP_UNITS units on, Student's t below."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

# the strategy name of full-cache rows drawn from the runs' own reference (`nll_full`) where no run is the
# full cache (a sweep whose streams outrun the reference's cap): a table's row, not a policy
RUNS_REFERENCE = "reference"


class PolicyOrder:
    """How the policies of a table are drawn, read from the table's own identity columns (every run records
    its policy's facts: strategy_label, strategy_order, evicts), so figures need no list of names."""

    def __init__(self, frame: pd.DataFrame):
        f = frame.drop_duplicates("strategy").set_index("strategy")
        self.order = {n: int(f.at[n, "strategy_order"]) if "strategy_order" in f else 100 for n in f.index}
        self.labels = {n: f.at[n, "strategy_label"] if "strategy_label" in f else n for n in f.index}
        self.references = set(f.index[is_reference(f).to_numpy()]) if "evicts" in f else set()
        self.non_causal = {n for n in f.index if "non_causal" in f and bool(f.at[n, "non_causal"])}

    def ordered(self, names=None) -> list[str]:
        names = list(dict.fromkeys(self.order if names is None else names))
        return sorted(names, key=lambda n: (self.order.get(n, 100), n))

    def label(self, name: str) -> str:
        return self.labels.get(name, name)

    def is_reference(self, name: str) -> bool:
        return name in self.references


def evicting(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of policies that evict (neither the full-cache reference nor an ablation of it)."""
    return frame[frame["evicts"].astype(bool)]


def is_reference(frame: pd.DataFrame) -> pd.Series:
    """Per row: is it the full-cache reference (keeps every entry, no ablation; tables from before the
    `ablation` column have none)."""
    ablation = frame["ablation"].eq(True) if "ablation" in frame else False
    return ~frame["evicts"].astype(bool) & ~ablation


def paired_delta(streams: pd.DataFrame) -> pd.Series:
    """Per stream: NLL under the policy minus NLL under the full cache, over the same predictions. Where the
    full-cache reference is capped (eval.full_max_len) `nll_full` covers only its first predictions, so
    the policy's side is `nll_paired` (its NLL over those); tables from before that column have none (the
    reference then covered every prediction, or the difference mixes spans: re-aggregate)."""
    nll = streams["nll_paired"].fillna(streams["nll"]) if "nll_paired" in streams else streams["nll"]
    return nll - streams["nll_full"]


def reference(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the full-cache reference."""
    return frame[is_reference(frame)]


def ablations(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of ablations of the full cache (bos_ablation)."""
    return frame[frame["ablation"].eq(True)] if "ablation" in frame else frame.iloc[:0]


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


MIN_BOOTSTRAP_UNITS = 10  # below this many units a percentile bootstrap under-covers: Student's t instead


def t_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean of the units, valid at small n where their
    mean is near normal (a percentile bootstrap over 4 values gives about a 70% interval)."""
    from scipy import stats

    values = np.asarray(values, dtype=float)
    point = float(values.mean())
    if len(values) < 2:
        return point, point, point
    half = float(
        stats.t.ppf(1 - (1 - level) / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    )
    return point, point - half, point + half


def mean_ci(values: np.ndarray, seed: int = 0) -> tuple[tuple[float, float, float], str]:
    """The CI `summarize_streams` gives a group of one training: a bootstrap from MIN_BOOTSTRAP_UNITS units
    on, Student's t below -> ((point, low, high), the method's name)."""
    if len(values) < MIN_BOOTSTRAP_UNITS:
        return t_ci(values), "t"
    return bootstrap_ci(values, seed=seed), "bootstrap"


def nested_bootstrap_ci(
    values: np.ndarray, clusters: np.ndarray, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(point, low, high) of the mean over clusters of each cluster's mean (e.g. training runs, then the
    streams each was evaluated on), by a two-stage bootstrap: resample the clusters, then the units inside
    each drawn cluster. The CI holds both sources of variation; with one cluster it is the plain one."""
    values, clusters = np.asarray(values, dtype=float), np.asarray(clusters)
    groups = [values[clusters == c] for c in pd.unique(clusters)]
    point = float(np.mean([g.mean() for g in groups]))
    if len(groups) < 2:
        return bootstrap_ci(values, seed=seed, n_boot=n_boot, level=level)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    boots = np.empty(n_boot)
    for i, pick in enumerate(picks):
        boots[i] = np.mean([g[rng.integers(0, len(g), len(g))].mean() for g in (groups[j] for j in pick)])
    lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
    return point, float(min(lo, point)), float(max(hi, point))


CLUSTER = "checkpoint"  # trainings of one recipe with different train.seed are different checkpoints


def summarize_streams(
    streams: pd.DataFrame, column: str, transform=None, keys=("strategy", "budget", "position_mode")
) -> pd.DataFrame:
    """Per (strategy, budget, position_mode) or other keys: point estimate and 95% CI of mean(column)
    over (seed, stream) units, optionally transformed (exp for perplexity). Where a group holds several
    checkpoints (training seeds of one recipe), the CI is hierarchical: training run, then stream
    (`nested_bootstrap_ci`); with one, a bootstrap over its units, or Student's t where they are fewer than
    MIN_BOOTSTRAP_UNITS (`mean_ci`). `n`: the units; `clusters`: the checkpoints they come from; `method`:
    the CI's."""
    rows = []
    keys = list(keys)
    for key, g in streams.groupby(keys, dropna=False):
        clusters = g[CLUSTER].to_numpy() if CLUSTER in g and CLUSTER not in keys else np.zeros(len(g))
        if len(pd.unique(clusters)) > 1:
            (point, lo, hi), method = nested_bootstrap_ci(g[column].to_numpy(), clusters), "nested bootstrap"
        else:
            (point, lo, hi), method = mean_ci(g[column].to_numpy())
        if transform is not None:
            point, lo, hi = transform(point), transform(lo), transform(hi)
        n_clusters = len(pd.unique(clusters))
        rows.append(
            dict(zip(keys, key, strict=True))
            | {"point": point, "low": lo, "high": hi, "n": len(g), "clusters": n_clusters, "method": method}
        )
    return pd.DataFrame(rows)


def run_settings(results: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """One row per run_key with the named config columns of results.parquet (renamed: {column: name})."""
    have = [c for c in columns if c in results]
    return results.drop_duplicates("run_key").set_index("run_key")[have].rename(columns=columns)


def run_labels(results: pd.DataFrame) -> pd.Series:
    """run_key -> what tells runs of one strategy apart: the conf/arm/ name where one was chosen, else the
    strategy parameters (and `dataset.bos`) that vary between its runs ("n_sink=1, bos=False"); "" where
    nothing does."""
    runs = results.drop_duplicates("run_key").set_index("run_key")
    params = [c for c in runs if c.startswith("cfg.strategy.params.")]
    params += [c for c in ("cfg.dataset.bos",) if c in runs]  # a stream with BOS first or without
    labels = pd.Series("", index=runs.index, dtype=object)
    for _, g in runs.groupby("strategy"):
        varying = [c for c in params if g[c].notna().any() and g[c].astype(str).nunique() > 1]
        for key, row in g.iterrows():
            labels[key] = ", ".join(
                f"{c.rsplit('.', 1)[1]}={_plain(row[c])}" for c in varying if pd.notna(row[c])
            )
    if "cfg.arm" in runs:
        arm = runs["cfg.arm"].fillna("none").astype(str)
        labels = labels.where(arm == "none", arm)
    return labels


def setting_labels(results: pd.DataFrame) -> pd.Series:
    """run_key -> `run_labels`, with the strategy parameters that still vary among the runs of one label
    appended (an arm run in every layer and in one layer at a time: "bos_key, layer=0"): the one name of a
    run's setting that every table and figure tells runs of one strategy apart by."""
    labels = run_labels(results)
    runs = results.drop_duplicates("run_key").set_index("run_key")
    params = [c for c in runs if c.startswith("cfg.strategy.params.")]
    names = labels.copy()
    for _, g in runs.assign(_label=labels).groupby(["strategy", "_label"]):
        varying = [c for c in params if g[c].notna().any() and g[c].astype(str).nunique() > 1]
        for key, row in g.iterrows():
            extra = [f"{c.rsplit('.', 1)[1]}={_plain(row[c])}" for c in varying if pd.notna(row[c])]
            names[key] = ", ".join(x for x in (labels[key], *extra) if x)
    return names


def sampled_runs(results: pd.DataFrame | None) -> set[str]:
    """The run_keys of runs that scored sampled steps only (eval.recompute_sample > 0): their NLL covers
    other predictions than a run that scored every step, so they pair with others only through the full
    cache (each side's difference to it on its own predictions)."""
    if results is None or "cfg.eval.recompute_sample" not in results:
        return set()
    return set(results.loc[results["cfg.eval.recompute_sample"].fillna(0) > 0, "run_key"])


SETTING_ORDER = 1000  # split_settings: the first order given a policy's runs that differ in a setting


def split_settings(frame: pd.DataFrame, results: pd.DataFrame | None) -> pd.DataFrame:
    """`frame` (rows with a run_key) with the runs of one strategy that differ in a setting (`setting_labels`:
    a parameter such as n_sink, BOS, an arm) told apart: strategy "name (n_sink=4)", strategy_label
    "label (n_sink=4)" and an order of their own from SETTING_ORDER (after the built-in policies, so a
    colour and marker of their own), in the base policy's order, then the setting's. Tables grouped by
    strategy then keep those runs apart instead of pooling them. Unchanged where nothing differs."""
    if results is None or results.empty or "run_key" not in frame or frame.empty:
        return frame
    labels = frame["run_key"].map(setting_labels(results)).fillna("").astype(str)
    split = labels != ""
    if not split.any():
        return frame
    P = PolicyOrder(frame)
    pairs = sorted(
        set(zip(frame.loc[split, "strategy"], labels[split], strict=True)),
        key=lambda p: (P.order.get(p[0], 100), p[0], p[1]),
    )
    order = {p: SETTING_ORDER + i for i, p in enumerate(pairs)}
    f = frame.copy()
    keys = list(zip(f.loc[split, "strategy"], labels[split], strict=True))
    f["strategy_label"] = f["strategy"].map(P.label).astype(object)
    f.loc[split, "strategy_label"] = [f"{P.label(s)} ({x})" for s, x in keys]
    f.loc[split, "strategy_order"] = [order[k] for k in keys]
    f["strategy"] = f["strategy"].astype(object)
    f.loc[split, "strategy"] = [f"{s} ({x})" for s, x in keys]
    return f


def _plain(v):
    """A config value as written: 0, not 0.0 (a column of ints with gaps reads back as floats)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def layer_values(layers: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The rows of one per-layer (or per-head) metric of the layers table."""
    return layers[layers["metric"] == metric] if not layers.empty else layers


def variants(names) -> list[str]:
    """Training variants in a stable order: the experiment's base first, then by name."""
    names = sorted(set(names))
    return (["base"] if "base" in names else []) + [n for n in names if n != "base"]


def first_position_mass(layers: pd.DataFrame) -> dict[str, np.ndarray]:
    """variant -> [L, H] full-cache attention on position 0 (original positions, mean over seeds)."""
    m = layer_values(layers, "first_position_mass")
    if m.empty:
        return {}
    m = reference(m)
    m = m[m["position_mode"] == "original"]
    out = {}
    for variant, g in m.groupby("variant"):
        grid = g.groupby(["layer", "head"])["value"].mean().unstack("head")
        out[variant] = grid.sort_index().sort_index(axis=1).to_numpy(dtype=float)
    return out


def eviction_arms(streams: pd.DataFrame) -> list[tuple[str, str]]:
    """Every (evicting policy, position mode) the streams hold, in figure order, original positions first."""
    P = PolicyOrder(streams)
    pairs = set(map(tuple, evicting(streams)[["strategy", "position_mode"]].drop_duplicates().to_numpy()))
    return sorted(pairs, key=lambda a: (P.order.get(a[0], 100), a[0], a[1] != "original", a[1]))


def eviction_ratios(streams: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, strategy, position_mode) of the evicting policies: exp(mean NLL - mean full-cache NLL)
    per stream, i.e. perplexity relative to the full cache, with its 95% bootstrap CI (point, low, high)."""
    s = evicting(streams).assign(delta=paired_delta)
    return summarize_streams(s, "delta", np.exp, keys=("variant", "strategy", "position_mode"))


def mode_ratios(streams: pd.DataFrame) -> pd.DataFrame:
    """Per (strategy, budget) of the evicting policies: the paired perplexity ratio cache / original
    positions, exp(mean over the units both modes streamed of NLL_cache - NLL_original), with its 95% CI
    (hierarchical where the units come from several trainings: a unit is (checkpoint, seed, stream))."""
    e = evicting(streams)
    units = [c for c in (CLUSTER, "seed", "stream") if c in e]
    both = e.pivot_table(index=["strategy", "budget", *units], columns="position_mode", values="nll")
    both = both.dropna(subset=["original", "cache"]).reset_index()
    return summarize_streams(
        both.assign(delta=both["cache"] - both["original"]), "delta", np.exp, ("strategy", "budget")
    )


# display names of models whose run name is a short config name (models/gguf.py's BUNDLED labels; a test
# holds them equal); any other model is shown by its name
MODEL_LABELS = {"smollm2_135m": "SmolLM2-135M-Instruct (Q4_1, dequantised)"}


def bucket_width(frame: pd.DataFrame) -> pd.Series:
    """Positions a curve's log-spaced bucket holds, from its `position` (sqrt(start x end)) and
    `position_start`."""
    start = frame["position_start"].astype(float)
    return frame["position"].astype(float) ** 2 / start.clip(lower=1e-9) - start


def pool_buckets(frame: pd.DataFrame, col: str, min_tokens: int) -> pd.DataFrame:
    """A curve's log-spaced position buckets (`position` = sqrt(start x end), `position_start`) pooled from
    the start until each holds >= min_tokens positions, so no point of a curve is one or two tokens' noise
    (the first buckets of a log axis hold one position each). Values are means weighted by positions held;
    a `stream` column, when present, is kept apart. Frames without `position_start` are returned as is."""
    if min_tokens <= 1 or "position_start" not in frame or frame.empty:
        return frame
    buckets = frame[["position_start", "position"]].drop_duplicates().sort_values("position_start")
    start = buckets["position_start"].to_numpy(float)
    width = bucket_width(buckets).to_numpy(float)
    group, held, gid = [], 0.0, 0
    for w in width:
        group.append(gid)
        held += w
        if held >= min_tokens:
            gid, held = gid + 1, 0.0
    by_start = pd.DataFrame({"_g": group, "_w": width}, index=start)
    keys = ["stream"] if "stream" in frame else []
    f = frame.join(by_start, on="position_start")
    f["_x"] = f[col] * f["_w"]
    out = f.groupby([*keys, "_g"], as_index=False)[["_x", "_w"]].sum()
    out[col] = out["_x"] / out["_w"]
    lo = pd.Series(start, index=group).groupby(level=0).min()
    hi = pd.Series(start + width, index=group).groupby(level=0).max()
    out["position_start"] = out["_g"].map(lo)
    out["position"] = np.sqrt(out["position_start"] * out["_g"].map(hi))
    return out[[*keys, "position", "position_start", col]]


def curve_band(
    frame: pd.DataFrame, col: str, level: float = 0.95, n_boot: int = 1000, seed: int = 0
) -> pd.DataFrame:
    """Per position of a per-stream curve (`stream`, `position`, col): the mean over streams and a
    bootstrap CI of that mean with streams as the resampled units (one resample for every position, so
    the band is a band of curves); `n` streams reach the position. Where fewer than two do, the band is
    the mean itself."""
    m = frame.pivot_table(index="stream", columns="position", values=col, aggfunc="mean")
    x = m.to_numpy(float)  # [streams, positions], NaN where a stream ends before the position
    n = np.isfinite(x).sum(axis=0)
    mean = np.nanmean(x, axis=0)
    low, high = mean.copy(), mean.copy()
    if len(x) > 1:
        idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
        with warnings.catch_warnings():  # a resample may hold no stream that reaches a late position
            warnings.simplefilter("ignore", RuntimeWarning)
            boots = np.nanmean(x[idx], axis=1)  # [n_boot, positions]
            lo, hi = np.nanquantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2], axis=0)
        ok = n > 1
        low[ok], high[ok] = np.minimum(lo[ok], mean[ok]), np.maximum(hi[ok], mean[ok])
    return pd.DataFrame(
        {"position": m.columns.to_numpy(float), "mean": mean, "low": low, "high": high, "n": n}
    )


def training_labels(results: pd.DataFrame) -> pd.Series:
    """checkpoint -> what tells a group's trainings apart: the training settings (`cfg.train.*`) that vary
    between its checkpoints ("seed=1, threads=2"); the checkpoint's name where none does."""
    if "checkpoint" not in results:
        return pd.Series(dtype=object)
    runs = results.drop_duplicates("checkpoint").set_index("checkpoint")
    cols = [c for c in runs if c.startswith("cfg.train.") and runs[c].astype(str).nunique() > 1]
    return pd.Series(
        {
            ck: ", ".join(f"{c[len('cfg.train.') :]}={row[c]}" for c in cols) or ck
            for ck, row in runs.iterrows()
        },
        dtype=object,
    )


def subject_caption(frame: pd.DataFrame) -> str:
    """What a figure's numbers are of, for its title: model(s), corpus and the number of independent
    streams (seed x stream units), e.g. "gpt_small on pydoc_topics, 16 streams"."""
    words = []
    if "model" in frame and frame["model"].notna().any():
        words.append(" / ".join(MODEL_LABELS.get(m, m) for m in sorted(frame["model"].dropna().unique())))
    if "dataset" in frame and frame["dataset"].notna().any():
        words.append("on " + " / ".join(sorted(frame["dataset"].dropna().astype(str).unique())))
    n = None
    if "stream" in frame:
        n = frame[[c for c in ("seed", "stream") if c in frame]].drop_duplicates().shape[0]
    elif "n_streams" in frame and frame["n_streams"].notna().any():
        n = int(frame["n_streams"].max()) * (frame["seed"].nunique() if "seed" in frame else 1)
    text = " ".join(words)
    if n is None:
        return text
    trainings = frame[CLUSTER].nunique() if CLUSTER in frame else 1
    of = f"{trainings} trainings x " if trainings > 1 else ""
    return f"{text}, {of}{n} stream{'s' if n != 1 else ''}"


def wilson_ci(k: int, n: int, level: float = 0.95) -> tuple[float, float, float]:
    """(share, low, high): k successes in n trials with Wilson's score interval (valid at small n and at 0
    or n successes, where the normal interval collapses to a point)."""
    from scipy.stats import norm

    if n == 0:
        return float("nan"), float("nan"), float("nan")
    z, p = norm.ppf(0.5 + level / 2), k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return p, max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided exact McNemar test of paired successes a, b (booleans, one pair per sample): the binomial
    test of the discordant pairs against 1/2; 1.0 where there are none."""
    from scipy.stats import binomtest

    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    if only_a + only_b == 0:
        return 1.0
    return float(binomtest(only_a, only_a + only_b, 0.5).pvalue)
