"""Aggregation of a tiny real sweep, bootstrap CIs, every figure function, and the HTML report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evictlab import run as run_mod
from evictlab.analysis import figures as F
from evictlab.analysis import stats as S
from evictlab.analysis.aggregate import aggregate, wide
from evictlab.analysis.report import load_tables
from evictlab.analysis.report import main as report_main
from evictlab.cache import POLICIES
from tests.test_pipeline import cfg_for


def with_facts(frame: pd.DataFrame) -> pd.DataFrame:
    """A synthetic table with the policy identity columns every run records (Policy.facts())."""
    facts = pd.DataFrame([POLICIES[s].facts() for s in frame["strategy"]], index=frame.index)
    return frame.assign(**{c: facts[c] for c in facts if c != "strategy"})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    outputs = tmp_path_factory.mktemp("sweep") / "outputs"
    for strategy in ("full", "window", "streaming_llm", "h2o"):
        for budget in ("b16", "b32"):
            for seed in (0, 1):
                for mode in ("original", "cache"):
                    cfg = cfg_for(outputs, f"strategy={strategy}", f"budget={budget}", f"seed={seed}",
                                  f"eval.position_mode={mode}", "logger=none", "group=t")  # fmt: skip
                    run_mod.run(cfg)
    # one failed run and one that never finished
    bad = cfg_for(outputs, "strategy=tova", "budget=b16", "logger=none", "group=t")
    d = run_mod.run_dir(bad)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("strategy: {name: tova}\nbudget: {name: b16}\nseed: 0\n")
    (d / "run_info.json").write_text("{}")
    (d / "metrics.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: boom"}))
    d2 = d.with_name("random-b16-unfinished")
    d2.mkdir()
    (d2 / "config.yaml").write_text("strategy: {name: random}\nbudget: {name: b16}\nseed: 0\n")
    (d2 / "run_info.json").write_text("{}")
    # and a run written by an older run format: listed as stale, never mixed into the results
    import shutil

    ok = run_mod.run_dir(cfg_for(outputs, "strategy=window", "budget=b16", "logger=none", "group=t"))
    old = shutil.copytree(ok, ok.with_name("window-b16-oldformat"))
    m = json.loads((old / "metrics.json").read_text())
    (old / "metrics.json").write_text(json.dumps(m | {"run_format": 1, "run_key": "0" * 16}))
    return outputs / "runs" / "t"


def test_aggregate_tidy_tables_and_failures(sweep: Path):
    t = aggregate([sweep], sweep)
    res = t["results"]
    # full ignores the budget: one run per seed x mode; the rest 3 x 2 budgets x 2 seeds x 2 modes
    assert res["run_key"].nunique() == 2 * 2 + 3 * 2 * 2 * 2
    assert {"metric", "value", "strategy", "budget", "seed", "position_mode", "cfg.model.name"} <= set(res)
    assert set(res.loc[res["metric"] == "ppl", "strategy"]) == {"full", "window", "streaming_llm", "h2o"}
    assert len(t["failures"]) == 3 and set(t["failures"]["status"]) == {"failed", "missing", "stale"}
    assert "boom" in t["failures"].loc[t["failures"]["status"] == "failed", "error"].iloc[0]
    assert (sweep / "results.parquet").exists() and (sweep / "failures.csv").exists()
    again = aggregate([sweep], sweep)  # idempotent
    pd.testing.assert_frame_equal(again["results"], pd.read_parquet(sweep / "results.parquet"))
    w = wide(res)
    assert len(w) == res["run_key"].nunique() and {"ppl", "kl_mean", "kv_bytes"} <= set(w)
    assert (t["streams"].groupby("run_key").size() == 2).all()
    # each stream names its documents (run_info.json's stream_documents): one text per seed and stream
    named = t["streams"].groupby(["seed", "stream"])["documents"].agg(set)
    assert named.map(len).tolist() == [1] * 4 and all(next(iter(x)) for x in named)
    assert named[0, 0] != named[1, 0]  # another seed, another stretch of text
    # every run records per layer the share of steps its cache holds each of positions 0-3
    held = t["layers"][t["layers"]["metric"].str.startswith("held_p")]
    p0 = held[held["metric"] == "held_p0"].groupby(["strategy", "budget"])["value"]
    assert (p0.min()[["full", "streaming_llm"]] == 1.0).all() and (p0.max()["window"] < 1).all()
    n = int(res["cfg.eval.stream_len"].iloc[0]) - 1
    assert np.allclose(p0.mean()["window", 16], 17 / n)  # steps 0 .. 16 attend to it, of n
    assert set(held["metric"]) == {"held_p0", "held_p1", "held_p2", "held_p3"}
    c = t["curves"]
    by_stream = c.groupby(["run_key", "stream"])
    assert c["position"].min() >= 1 and by_stream["position_start"].is_monotonic_increasing.all()
    assert (c.groupby("run_key")["stream"].nunique() == 2).all()  # per stream: a figure can draw a band
    # the mean over streams of each bucket's per-stream means is the bucket's mean (equal-length streams)
    one = c[c["run_key"] == c["run_key"].iloc[0]]
    pt = pd.read_parquet(
        Path(res.loc[res["run_key"] == one["run_key"].iloc[0], "run_dir"].iloc[0]) / "per_token.parquet"
    )
    first = one[one["position_start"] == one["position_start"].max()]
    tail = pt[pt["position"] >= first["position_start"].iloc[0]]
    assert abs(first["nll"].mean() - tail["nll"].astype(float).mean()) < 1e-6  # (float32 per token)


def test_a_run_of_an_earlier_format_with_the_same_meaning_is_read(sweep: Path, tmp_path: Path):
    import shutil

    ok = next(p.parent for p in sweep.rglob("metrics.json") if json.loads(p.read_text())["status"] == "ok")
    group = tmp_path / "outputs" / "runs" / "g"
    old = shutil.copytree(ok, group / ok.name)
    m = json.loads((old / "metrics.json").read_text())
    m.pop("weights_sha256")
    (old / "metrics.json").write_text(json.dumps(m | {"run_format": 3}))  # 3: before weights_sha256
    t = aggregate([group])
    assert t["failures"].empty and t["results"]["run_key"].nunique() == 1
    assert t["results"]["weights_sha256"].isna().all()


def test_a_format_4_run_reads_under_the_current_names_and_stays_done(sweep: Path, tmp_path: Path):
    """RUN_FORMAT 5 renamed `sink_mass` to `first4_mass` (one name per quantity): a format-4 run folder, with
    the old per-token columns and layers metric, aggregates under the new names and is not redone."""
    import shutil

    from evictlab import results as R
    from evictlab.identity import is_done

    ok = next(p.parent for p in sweep.rglob("metrics.json") if json.loads(p.read_text())["status"] == "ok")
    group = tmp_path / "outputs" / "runs" / "g"
    old = shutil.copytree(ok, group / ok.name)
    pt = pd.read_parquet(old / "per_token.parquet")
    assert "first4_mass_mean" in pt
    pt.rename(columns=lambda c: c.replace("first4_mass", "sink_mass")).to_parquet(old / "per_token.parquet")
    layers = pd.read_parquet(old / "layers.parquet")
    layers["metric"] = layers["metric"].replace({"first4_mass": "sink_mass"})
    layers.to_parquet(old / "layers.parquet")
    m = json.loads((old / "metrics.json").read_text())
    (old / "metrics.json").write_text(json.dumps(m | {"run_format": 4}))
    assert is_done(old)
    t = aggregate([group], group)
    assert t["failures"].empty and "sink_mass" not in set(t["layers"]["metric"])
    assert (t["layers"]["metric"] == "first4_mass").any()
    # and an aggregated table written before the rename reads under the new names too
    t["layers"].assign(metric=t["layers"]["metric"].replace({"first4_mass": "sink_mass"})).to_parquet(
        group / "layers.parquet"
    )
    assert "first4_mass" in set(R.read_tables(group)["layers"]["metric"])
    assert R.current_names(pd.DataFrame({"sink_mass_l3": [1.0]})).columns.tolist() == ["first4_mass_l3"]


def test_a_renamed_config_key_merges_with_its_current_name():
    """Scissorhands' `recent` became `n_recent` (l2norm's name for the same count): a table holding both
    columns reads as one, and h2o's `recent_fraction` (another quantity) is left as it is."""
    from evictlab import results as R

    old = pd.DataFrame(
        {
            "strategy": ["scissorhands", "l2norm", "h2o"],
            "cfg.strategy.params.recent": [4.0, np.nan, np.nan],
            "cfg.strategy.params.n_recent": [np.nan, 0.0, np.nan],
            "cfg.strategy.params.recent_fraction": [np.nan, np.nan, 0.5],
        }
    )
    now = R.current_names(old)
    assert sorted(now.columns) == sorted(
        ["strategy", "cfg.strategy.params.n_recent", "cfg.strategy.params.recent_fraction"]
    )
    assert now["cfg.strategy.params.n_recent"].tolist()[:2] == [4.0, 0.0]
    assert now["cfg.strategy.params.recent_fraction"].tolist()[2] == 0.5
    alone = R.current_names(old[["strategy", "cfg.strategy.params.recent"]].iloc[:1])
    assert alone.columns.tolist() == ["strategy", "cfg.strategy.params.n_recent"]


def test_bootstrap_ci_contains_the_point():
    rng = np.random.default_rng(0)
    for n in (2, 5, 40):
        v = rng.normal(size=n)
        point, lo, hi = S.bootstrap_ci(v)
        assert lo <= point <= hi and point == pytest.approx(v.mean())
    assert S.bootstrap_ci(np.array([3.0])) == (3.0, 3.0, 3.0)


def synthetic_streams() -> pd.DataFrame:
    rng = np.random.default_rng(1)
    rows = []
    for s in ("full", "window", "h2o", "oracle"):
        for b in (16, 64, 256):
            for mode in ("original", "cache"):
                for seed in (0, 1):
                    for stream in range(4):
                        base = 1.0 + (0 if s == "full" else 4 / b)
                        rows.append({
                            "strategy": s, "budget": b, "position_mode": mode, "seed": seed, "stream": stream,
                            "nll": base + rng.normal(0, 0.02), "kl": 0 if s == "full" else 2 / b,
                            "agree": 1 - (0 if s == "full" else 1 / b),
                        })  # fmt: skip
    return with_facts(pd.DataFrame(rows))


def synthetic_runs() -> pd.DataFrame:
    s = (
        synthetic_streams()
        .groupby(["strategy", "budget", "position_mode", "seed"], as_index=False)["nll"]
        .mean()
    )
    s["ppl"] = np.exp(s["nll"])
    s["kv_bytes"] = s["budget"] * 4096
    s["token_steps_per_s"] = np.where(s["strategy"] == "h2o", 3000.0, 20000.0)
    s["policy_time_share"] = np.where(s["strategy"] == "h2o", 0.2, 0.0)
    full = s[s["strategy"] == "full"].groupby(["position_mode", "seed"])["ppl"].mean().rename("ppl_full")
    s = s.merge(full.reset_index(), on=["position_mode", "seed"], how="left")
    return with_facts(s)


def synthetic_task_runs() -> pd.DataFrame:
    """synthetic_runs as a task sweep: answers' exact share, decode rates, SDPA rates where no weights."""
    s = synthetic_runs()
    s["task_exact"] = np.where(s["strategy"] == "full", 0.8, 0.2 + s["budget"] / 200)
    s["decode_token_steps_per_s"] = np.where(s["strategy"] == "h2o", 40.0, 60.0)
    s["decode_token_steps_per_s_fused"] = np.where(s["strategy"] == "h2o", np.nan, 90.0)
    return s


def synthetic_layers() -> pd.DataFrame:
    rows = [{"strategy": "window", "run_key": k, "layer": layer, "head": None, "metric": "first4_mass",
             "value": 0.1 * layer} for k in ("a", "b") for layer in range(4)]  # fmt: skip
    return with_facts(pd.DataFrame(rows))


def synthetic_curves() -> pd.DataFrame:
    rows = []
    for s in ("full", "window", "h2o"):
        for b in (16, 64):
            for p in (1, 2, 4, 8, 16, 32, 64, 128):
                rows.append({"strategy": s, "budget": b, "position_mode": "original", "position": p,
                             "nll": 2 - 0.1 * np.log(p) + (0 if s == "full" else 0.01 * p / b)})  # fmt: skip
    return with_facts(pd.DataFrame(rows))


def synthetic_attention() -> pd.DataFrame:
    rows = [{"layer": layer, "key_position": j, "attention": (0.5 if j == 0 else 0.01) / (1 + layer)}
            for layer in range(3) for j in range(200)]  # fmt: skip
    return pd.DataFrame(rows)


def synthetic_recall() -> pd.DataFrame:
    rows = [{"strategy": s, "budget": b, "position_mode": "original", "depth": d, "stream": i,
             "exact_greedy": bool((s == "full") or (d > 0.5) or (b >= 64)),
             "exact_teacher_forced": bool((s == "full") or (d > 0.5) or (b >= 64))}
            for s in ("full", "window", "h2o") for b in (16, 64) for d in (0.1, 0.5, 0.9)
            for i in range(2)]  # fmt: skip
    return with_facts(pd.DataFrame(rows))


FIGS = [
    (
        "ppl_vs_budget",
        lambda: F.ppl_vs_budget(synthetic_streams()),
        "KV budget (entries per layer)",
        "perplexity",
    ),
    ("kl_vs_budget", lambda: F.kl_vs_budget(synthetic_streams()), "KV budget (entries per layer)", "KL"),
    (
        "agreement",
        lambda: F.agreement_vs_budget(synthetic_streams()),
        "KV budget (entries per layer)",
        "agreement",
    ),
    ("nll_vs_position", lambda: F.nll_vs_position(synthetic_curves(), 16), "token position", "NLL"),
    ("quality_vs_memory", lambda: F.quality_vs_memory(synthetic_runs()), "KV cache held", "perplexity"),
    ("throughput", lambda: F.throughput(synthetic_runs()), "token-steps / s", ""),
    ("tradeoff", lambda: F.tradeoff(synthetic_runs()), "KV cache held", "perplexity"),
    ("tradeoff_tasks", lambda: F.tradeoff(synthetic_task_runs()), "KV cache held", "answers written"),
    ("first4_mass", lambda: F.first4_mass(synthetic_layers()), "layer", "% attention"),
    ("position_modes", lambda: F.position_modes(synthetic_streams()), "", "perplexity"),
    ("attention_heatmap", lambda: F.attention_heatmap(synthetic_attention()), "key position", "layer"),
    ("recall_heatmaps", lambda: F.recall_heatmaps(synthetic_recall()), "budget", "needle depth"),
]


@pytest.mark.parametrize("name, make, xlabel, ylabel", FIGS, ids=[f[0] for f in FIGS])
def test_figure_functions(name, make, xlabel, ylabel, tmp_path: Path):
    import matplotlib.pyplot as plt

    fig = make()
    ax = fig.axes[0]
    assert xlabel in ax.get_xlabel() and ylabel in ax.get_ylabel()
    assert ax.has_data()
    legend_texts = [t.get_text() for a in fig.axes if a.get_legend() for t in a.get_legend().get_texts()]
    if name in ("ppl_vs_budget", "kl_vs_budget"):
        assert "full cache" in legend_texts and POLICIES["oracle"].label in legend_texts
    for ext in ("png", "pdf"):
        fig.savefig(tmp_path / f"{name}.{ext}")
        assert (tmp_path / f"{name}.{ext}").stat().st_size > 1000
    plt.close(fig)


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    x, y = np.array([1, 2, 3, 4, 5.0]), np.array([0.2, 0.1, 0.5, 0.5, 0.9])
    assert F.pareto_front(x, y, x_low=True).tolist() == [0, 2, 4]  # less memory, more quality
    assert F.pareto_front(x, y, x_low=False).tolist() == [4]  # faster and better: the last beats all
    # ties on x (every policy at one budget holds the same memory): only the best point at that x
    x, y = np.array([1, 1, 2, 2, 2, 3.0]), np.array([0.0, 0.04, 0.08, 0.12, 0.1, 0.64])
    assert F.pareto_front(x, y, x_low=True).tolist() == [1, 3, 5]


def test_the_tradeoff_figure_draws_the_fused_rate_beside_the_explicit_one():
    fig = F.tradeoff(synthetic_task_runs())
    speed = fig.axes[1]
    assert "decode token-steps" in speed.get_xlabel() and "SDPA" in speed.get_xlabel()
    xs = {round(float(x), 3) for line in speed.get_lines() for x in np.atleast_1d(line.get_xdata())}
    assert {40.0, 60.0, 90.0} <= xs  # H2O's explicit rate; the others' explicit and fused rates
    assert "answers written exactly" in fig.axes[0].get_ylabel()
    assert "not drawn" not in fig._suptitle.get_text()


def test_the_tradeoff_figure_names_a_policy_without_a_quality_value_instead_of_drawing_it():
    """The oracle writes no answers (task_exact NaN): no legend entry without a point; the title says so."""
    runs = synthetic_task_runs()
    runs.loc[runs["strategy"] == "oracle", "task_exact"] = np.nan
    fig = F.tradeoff(runs)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert not [lab for lab in labels if lab.startswith("oracle")] and any(lab == "h2o" for lab in labels)
    assert "not drawn (writes nothing to score): oracle (non-causal, greedy)" in fig._suptitle.get_text()


def test_policy_order_labels_and_colours_come_from_the_tables():
    frame = with_facts(pd.DataFrame({"strategy": sorted(POLICIES)}))
    unknown = pd.DataFrame(
        [{"strategy": "zzz", "strategy_label": "Z", "strategy_order": 100, "evicts": True}]
    )
    P = F.Policies(pd.concat([frame, unknown], ignore_index=True))
    assert P.ordered()[:3] == ["full", "window", "streaming_llm"] and P.ordered()[-1] == "zzz"
    assert P.ordered() == sorted(P.order, key=lambda n: (POLICIES[n].order if n in POLICIES else 100, n))
    assert (
        P.label("oracle") == POLICIES["oracle"].label and P.label("zzz") == "Z" and P.references == {"full"}
    )
    colours = [tuple(P.color(n)) for n in POLICIES]
    assert len(set(colours)) == len(POLICIES)
    # past the ten built-in orders colours stay distinct and fixed by the order (was grey for all of them)
    many = [tuple(F.policy_color(k)) for k in range(60)] + [tuple(P.color("zzz"))]
    assert len(set(many)) == len(many) and P.color("zzz") == F.policy_color(100)
    assert all(0 <= c <= 1 for rgb in many for c in rgb)


def test_report_references_every_figure(sweep: Path, tmp_path: Path):
    out, report = tmp_path / "figs", tmp_path / "report" / "index.html"
    aggregate([sweep], sweep)
    assert report_main([str(sweep), "--out", str(out), "--report", str(report), "--no-wandb"]) == 0
    html = report.read_text()
    figs = F.draw_all(load_tables(sweep))
    expected = {"ppl_vs_budget", "position_modes", "nll_vs_position", "first4_mass", "attention_heatmap"}
    assert expected <= set(figs)
    for stem in figs:
        assert (out / f"{stem}.png").exists() and (out / f"{stem}.pdf").exists()
        assert f"id='{stem}'" in html and f"alt='{stem}'" in html
    assert html.count("data:image/png;base64,") == len(figs)
    assert "Failed or unfinished runs" in html and "boom" in html
    assert "StreamingLLM" in html and "perplexity [95% CI]" in html


def test_each_group_gets_its_own_world_readable_report(sweep: Path, tmp_path: Path, monkeypatch):
    import shutil
    import stat

    from evictlab.analysis.report import group_of
    from evictlab.store import UMASK

    aggregate([sweep], sweep)
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("EVICTLAB_OUTPUTS", str(outputs))
    for group in ("smoke", "ablation/bos"):
        shutil.copytree(sweep, outputs / "runs" / group)
        assert group_of(outputs / "runs" / group) == group
        assert report_main([str(outputs / "runs" / group), "--no-wandb"]) == 0
    for group in ("smoke", "ablation/bos"):  # the second report did not overwrite the first
        page = outputs / "report" / group / "index.html"
        assert f"<h1>evictlab: {group}</h1>" in page.read_text()
        # the mode open() would give (0644 under the usual umask 022), not mkstemp's owner-only 0600
        assert stat.S_IMODE(page.stat().st_mode) == 0o666 & ~UMASK
        assert (outputs / "figures" / group / "ppl_vs_budget.png").exists()
    assert group_of(tmp_path / "elsewhere") == "elsewhere"


def browser() -> str | None:
    """Chromium (Debian's `chromium`, or Chrome), or None; $EVICTLAB_REQUIRE_BROWSER=1 (CI sets it) makes a
    missing one a failure instead of a skip."""
    import os
    import shutil

    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if found is None and os.environ.get("EVICTLAB_REQUIRE_BROWSER") == "1":
        pytest.fail("EVICTLAB_REQUIRE_BROWSER=1 but no chromium: apt-get install chromium")
    return found


# appended to a copy of the page: after load, record which images decoded and what the tables hold
PROBE = """<script>addEventListener('load', () => {
  const b = document.body.dataset;
  b.decoded = [...document.images].filter(i => i.complete && i.naturalWidth > 0).map(i => i.alt).join(',');
  b.tables = document.querySelectorAll('table').length;
  b.headings = [...document.querySelectorAll('h2')].map(h => h.textContent).join('|');
})</script>"""


def render(chrome: str, page: Path, tmp: Path) -> dict[str, str]:
    """The page as headless Chromium rendered it: the probe's data attributes of <body>."""
    import re
    import subprocess

    probed = tmp / f"probed-{page.parent.name}.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp / 'chromium'}", "--virtual-time-budget=5000", "--dump-dom"]  # fmt: skip
    dom = subprocess.run(
        [chrome, *flags, probed.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    return dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1)))


def test_reports_render_in_a_real_browser(sweep: Path, tmp_path: Path, monkeypatch):
    """Two groups' reports, each opened in headless Chromium: every figure decodes as an image, the
    tables are there, and the second report did not replace the first."""
    import shutil

    chrome = browser()
    if chrome is None:
        pytest.skip("no chromium (apt-get install chromium); CI installs it")
    aggregate([sweep], sweep)
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("EVICTLAB_OUTPUTS", str(outputs))
    figs = set(F.draw_all(load_tables(sweep)))
    for group in ("first", "second"):
        shutil.copytree(sweep, outputs / "runs" / group)
        assert report_main([str(outputs / "runs" / group), "--no-wandb"]) == 0
    for group in ("first", "second"):
        seen = render(chrome, outputs / "report" / group / "index.html", tmp_path)
        assert set(seen["decoded"].split(",")) == figs, seen
        assert int(seen["tables"]) >= 2 and "Headline numbers" in seen["headings"], seen


def test_fixed_decimals_drop_the_sign_of_a_rounded_zero():
    from evictlab.analysis.report import fixed

    values = (-6e-9, 6e-9, -0.00012, float("nan"))
    assert [fixed("{:.4f}", v) for v in values] == ["0.0000", "0.0000", "-0.0001", "-"]
    assert fixed("{:,.0f}", -0.4) == "0" and fixed("{:,.0f}", 1234.0) == "1,234"


def test_the_report_flags_thin_cis_formats_numbers_and_shares_only_shared_settings(sweep: Path):
    from evictlab.analysis.aggregate import subject_lines
    from evictlab.analysis.report import MIN_UNITS, headline_table, shared_settings

    aggregate([sweep], sweep)
    tables = load_tables(sweep)
    head = headline_table(tables)
    thin = head["units (seed x stream)"] < MIN_UNITS
    assert thin.any() and (thin == head["perplexity [95% CI]"].str.endswith(" *")).all()
    full = head[head["strategy"] == POLICIES["full"].label]
    assert set(full["kl_mean"]) == {"0.0000"} and set(full["agreement"]) == {"1.000"}
    shared = shared_settings(tables["results"])
    assert shared["cfg.model.name"] == "gpt_tiny" and shared["cfg.group"] == "t"
    assert not [k for k in shared.index if k.startswith(("cfg.strategy.", "cfg.seed", "cfg.budget."))]
    assert "cfg.tokenizer.vocab_size" not in shared  # the byte tokenizer has no vocabulary size to set
    assert not shared.isna().any()
    lines = subject_lines(tables["results"])
    assert lines[0].startswith("gpt_tiny (") and ", weights sha256 " in lines[0]
    assert any(line.startswith("evictlab commit ") for line in lines)


def test_report_cli_bad_input(tmp_path: Path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "no such sweep folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "run `python -m evictlab.aggregate" in capsys.readouterr().err
    aggregate([tmp_path / "empty"], tmp_path / "empty")  # aggregated, but nothing finished
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_report_figures_and_table_are_mirrored_to_wandb(sweep: Path, tmp_path: Path):
    from tests.wandb_reader import read_run

    out = tmp_path / "figs"
    # the sweep fixture ran with logger=none; the same tables with offline logging write a report run
    from evictlab.analysis.report import _log_to_wandb

    aggregate([sweep], sweep)
    tables = load_tables(sweep)
    figs = F.draw_all(tables)
    out.mkdir()
    for stem, fig in figs.items():
        fig.savefig(out / f"{stem}.png")
    # the sweep ran with logger=none; a sweep whose runs log offline: its report run is offline too
    offline = tmp_path / "t" / "run"
    offline.mkdir(parents=True)
    (offline / "config.yaml").write_text(f"logger: {{mode: offline}}\npaths: {{outputs: {tmp_path}}}\n")
    (offline / "run_info.json").write_text("{}")
    _log_to_wandb(offline.parent, tables, out, figs)
    files = list(tmp_path.glob("wandb/offline-run-*-report-t/run-report-t.wandb"))
    assert len(files) == 1
    wb = read_run(files[0])
    assert wb["job_type"] == "report" and wb["group"] == "t"
    logged = {k.split("/")[1] for h in wb["history"] for k in h if k.startswith("figures/")}
    assert logged == set(figs)
    assert any(k.startswith("headline") for h in wb["history"] for k in h)


def test_recall_heatmaps_wrap_and_mark_policies_that_cannot_generate():
    import matplotlib.pyplot as plt

    rec = synthetic_recall()
    oracle = rec[rec["strategy"] == "h2o"].assign(strategy="oracle", exact_greedy=np.nan)
    more = [rec.assign(strategy=s) for s in ("tova", "scissorhands", "random")]
    fig = F.recall_heatmaps(with_facts(pd.concat([rec, oracle, *more], ignore_index=True)))
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    oracle = POLICIES["oracle"].label
    assert len(titles) == 7 and titles[-1] == oracle  # 7 panels over 2 rows of 5
    oracle_ax = next(a for a in fig.axes if a.get_title() == oracle)
    assert "cannot generate" in oracle_ax.texts[0].get_text()
    plt.close(fig)


def test_cost_vs_budget_is_the_paired_ratio_and_gives_outliers_their_own_panel():
    import matplotlib.pyplot as plt

    rows = []
    for name, gap in (("window", 0.1), ("h2o", 0.05), ("l2norm", 2.0)):
        for b in (16, 64):
            for stream in range(6):
                full = 1.0 + 0.1 * stream  # streams differ in difficulty; the paired ratio does not see it
                rows.append({"strategy": name, "budget": b, "position_mode": "original", "seed": 0,
                             "stream": stream, "nll": full + gap * 16 / b, "nll_full": full})  # fmt: skip
    streams = with_facts(pd.DataFrame(rows))
    fig = F.cost_vs_budget(streams)
    assert len(fig.axes) == 2 and [a.get_title() for a in fig.axes] == [
        "policies within 2x of the full cache at every budget",
        "policies beyond 2x at some budget",
    ]
    near = {
        ln.get_label(): ln.get_ydata().tolist()
        for ln in fig.axes[0].get_lines()
        if ln.get_label() != "full cache"
    }
    assert near["window"] == pytest.approx(
        [np.exp(0.1), np.exp(0.025)]
    )  # exact: every stream has the same gap
    assert set(near) == {"window", "h2o"} and "l2norm" in [ln.get_label() for ln in fig.axes[1].get_lines()]
    plt.close(fig)
    one = F.cost_vs_budget(streams[streams["strategy"] != "l2norm"])
    assert len(one.axes) == 1
    plt.close(one)


def test_nll_vs_position_keeps_one_stream_length():
    """A group can hold streams of several lengths (long_stream, long_stream_1m): `stream_len` draws one."""
    import matplotlib.pyplot as plt

    short = synthetic_curves().assign(stream_len=129)
    long = synthetic_curves().assign(stream_len=1025, nll=lambda d: d["nll"] + 5)
    both = pd.concat([short, long], ignore_index=True)
    fig = F.nll_vs_position(both, 16, stream_len=129)
    tops = [line.get_ydata().max() for line in fig.axes[0].get_lines() if len(line.get_ydata()) > 2]
    assert tops and max(tops) < 3  # no line from the 1025-token runs (their NLL is 5 higher)
    fig_all = F.nll_vs_position(both, 16)
    assert (
        max(line.get_ydata().max() for line in fig_all.axes[0].get_lines() if len(line.get_ydata()) > 2) > 3
    )
    plt.close("all")


def test_sinks_vs_count_is_the_paired_ratio_per_count_bos_and_mode():
    """StreamingLLM's initial-token table as a figure: one line per (BOS first or not, position mode), x the
    number of initial positions kept, y exp(mean NLL - full-cache NLL) over the streams of those runs."""
    import matplotlib.pyplot as plt

    rows, settings = [], []
    for n_sink in (0, 1, 4):
        for bos in (True, False):
            for mode in ("original", "cache"):
                key = f"k{n_sink}{bos}{mode}"
                gap = (
                    (1.0 if n_sink == 0 else 0.1) + (0.5 if not bos else 0) + (0.2 if mode == "cache" else 0)
                )
                settings.append({"run_key": key, "cfg.strategy.params.n_sink": n_sink, "cfg.dataset.bos": bos,
                                 "metric": "ppl", "value": 1.0})  # fmt: skip
                for stream in range(5):
                    full = 2.0 + 0.3 * stream
                    rows.append({"run_key": key, "strategy": "streaming_llm", "budget": 64,
                                 "position_mode": mode, "seed": 0, "stream": stream, "nll": full + gap,
                                 "nll_full": full})  # fmt: skip
    streams, results = with_facts(pd.DataFrame(rows)), pd.DataFrame(settings)
    fig = F.sinks_vs_count(streams, results)
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines["BOS first, original positions"] == pytest.approx(np.exp([1.0, 0.1, 0.1]))
    assert lines["no BOS, cache positions"] == pytest.approx(np.exp([1.7, 0.8, 0.8]))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0", "1", "4"]
    assert "budget 64; 5 streams" in fig.axes[0].get_title()
    tables = {"streams": streams, "results": results}
    assert F.FIGURES["sinks_vs_count"].applies(tables)
    assert not F.FIGURES["sinks_vs_count"].applies({"streams": streams, "results": results.iloc[:1]})
    plt.close("all")


def test_nll_vs_position_draws_a_band_across_streams_and_the_reference_without_a_full_run():
    rows = []
    for strategy, shift in (("streaming_llm", 0.0), ("window", 1.0)):
        for stream in range(3):
            for position in (1.0, 10.0, 100.0, 1000.0):
                full = 2.0 + 0.1 * stream if position < 500 else np.nan  # the reference stops at its cap
                rows.append(
                    {
                        "strategy": strategy,
                        "strategy_label": strategy,
                        "strategy_order": int(shift),
                        "evicts": True,
                        "budget": 64,
                        "position_mode": "cache",
                        "stream_len": 1001,
                        "stream": stream,
                        "position": position,
                        "nll": 2.5 + shift + 0.2 * stream,
                        "nll_full": full,
                    }
                )
    fig = F.nll_vs_position(pd.DataFrame(rows), budget=64, mode="cache", context=500, context_label="context")
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels[0] == "full cache (reference)" and "context (500)" in labels
    ref = ax.get_lines()[0]
    assert list(ref.get_xdata()) == [1.0, 10.0, 100.0] and np.allclose(
        ref.get_ydata(), 2.1
    )  # mean of streams
    bands = [c for c in ax.collections if c.get_paths()]
    assert len(bands) == 3  # one per line: the reference and two policies
    lo, hi = bands[1].get_paths()[0].vertices[:, 1].min(), bands[1].get_paths()[0].vertices[:, 1].max()
    assert 2.5 <= lo < 2.7 < hi <= 2.9  # streaming_llm: the CI of the mean of streams at 2.5, 2.7, 2.9
    assert "95% CI of the mean over streams" in ax.get_title()


def test_curve_band_is_a_bootstrap_ci_of_the_mean_over_streams():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 1.0, size=(64, 2))  # 64 streams x 2 positions
    values[32:, 1] = np.nan  # half the streams end before the second position
    frame = pd.DataFrame(
        [
            {"stream": s, "position": p, "nll": values[s, i]}
            for s in range(64)
            for i, p in enumerate((5.0, 50.0))
        ]
    ).dropna()
    band = S.curve_band(frame, "nll")
    assert list(band["n"]) == [64, 32] and np.allclose(band["mean"], np.nanmean(values, axis=0))
    half = (band["high"] - band["low"]) / 2
    expected = 1.96 * np.nanstd(values, axis=0, ddof=1) / np.sqrt([64, 32])  # the normal-theory width
    assert np.allclose(half, expected, rtol=0.2)
    assert (band["low"] < band["mean"]).all() and (band["mean"] < band["high"]).all()
    one = S.curve_band(frame[frame["stream"] == 0], "nll")  # one stream: no band
    assert (one["low"] == one["mean"]).all() and (one["high"] == one["mean"]).all()


def test_the_figure_style_is_scoped():
    """Drawing in evictlab's style leaves matplotlib as it found it (rcParams and colour codes)."""
    import matplotlib as mpl
    from matplotlib import colors as mcolors

    before = dict(mpl.rcParams)
    black = mcolors.to_rgb("k")
    with F.style():
        assert mpl.rcParams["axes.facecolor"] == "white" and mpl.rcParams["axes.grid"]
        assert mcolors.to_rgb("k") != black  # seaborn's colour codes inside
        F.ppl_vs_budget(synthetic_streams())
    assert dict(mpl.rcParams) == before and mcolors.to_rgb("k") == black


def test_figures_tell_overlapping_policies_apart_and_name_their_subject():
    from evictlab.analysis.stats import MODEL_LABELS, subject_caption
    from evictlab.models.gguf import BUNDLED

    assert set(MODEL_LABELS.values()) == {b.label for b in BUNDLED.values()}  # one name for the model
    streams = synthetic_streams()
    P = F.Policies(streams)
    names = P.ordered()
    assert len({(P.marker(n), P.linestyle(n)) for n in names}) == len(names)
    fig = F.ppl_vs_budget(streams)
    ax = fig.axes[0]
    legend = ax.get_legend()
    # the legend sits beside the axes, not on the data
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1 - 1
    assert subject_caption(streams) in ax.get_title()
    frame = pd.DataFrame({"model": "smollm2_135m", "dataset": "man_pages", "seed": 0, "stream": range(4)})
    assert subject_caption(frame) == "SmolLM2-135M-Instruct (Q4_1, dequantised) on man_pages, 4 streams"


def test_the_oracle_is_drawn_but_never_on_the_pareto_front():
    runs = synthetic_runs()
    oracle = runs["strategy"] == "oracle"
    assert runs.loc[oracle, "non_causal"].all()
    runs.loc[oracle, "ppl"] /= 10  # better than everything, at every budget
    fig = F.quality_vs_memory(runs)
    ax = fig.axes[0]
    front = next(line for line in ax.get_lines() if line.get_label() == "Pareto front")
    oracle = next(line for line in ax.get_lines() if line.get_label().startswith("oracle"))
    assert not set(front.get_ydata()) & set(oracle.get_ydata())


def test_a_narrow_ratio_axis_is_linear_and_sink_colours_are_anchored_at_the_sink_threshold():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([32, 64], [1.004, 1.012])
    F._log_y(ax)  # 1.004-1.012 on a log axis labels its ticks 1.01, 1.01, 1, 1
    assert ax.get_yscale() == "linear"
    fig2, ax2 = plt.subplots()
    ax2.plot([32, 64], [1.2, 9.0])
    F._log_y(ax2)
    assert ax2.get_yscale() == "log"
    assert F.SINK_THRESHOLD == 0.3


def test_throughput_shows_the_spread_over_runs_and_says_which_policies_have_no_policy_step():
    runs = synthetic_runs()
    runs["path"] = np.where(runs["strategy"] == "h2o", "blocked", "parallel")
    fig = F.throughput(runs)
    speed, share = fig.axes
    assert speed.containers and any(c.has_xerr for c in speed.containers if hasattr(c, "has_xerr"))
    notes = [t.get_text() for t in share.texts]
    assert notes.count("no per-step policy call (parallel path)") == runs["strategy"].nunique() - 1
    assert (
        fig._suptitle.get_text() == "Speed and policy overhead (12 runs per policy; CPU)"
    )  # no caption: none
    runs["model"], runs["dataset"], runs["n_streams"] = "gpt_small", "man_pages", 8
    title = F.throughput(runs)._suptitle.get_text()
    assert title.split("\n")[1].startswith("gpt_small on man_pages, ")  # (8 streams x the seeds)


def test_sink_trend_reaches_the_sink_threshold_and_labels_its_reference_lines():
    from tests.test_variants import _variant_tables

    layers, runs = _variant_tables()
    fig = F.sink_trend(layers, runs, {"training steps": {"steps200": 200, "base": 400, "steps800": 800}})
    top, bottom = fig.axes[0], fig.axes[1]
    assert top.get_ylim()[1] >= 30 + 5  # a few percent does not fill the axis
    assert "sink head (Gu et al.: 30%)" in [ln.get_label() for ln in top.get_lines()]
    assert "full cache" in [ln.get_label() for ln in bottom.get_lines()]
    assert fig._suptitle.get_text().startswith("Does a sink grow")


def test_pooled_position_buckets_hold_enough_tokens_and_keep_the_mean():
    """nll_vs_position pools the first log-spaced buckets (one position each) until each holds >= 16
    positions: the token-weighted mean of each stream's curve is unchanged and streams stay apart."""
    from evictlab.results import position_buckets

    edges = position_buckets(4096)
    start, end = edges[:-1], edges[1:]
    rng = np.random.default_rng(0)
    rows = [
        {"stream": k, "position": np.sqrt(s * e), "position_start": s, "nll": v}
        for k in range(2)
        for s, e, v in zip(start, end, rng.normal(2 + k, 1, len(start)), strict=True)
    ]
    frame = pd.DataFrame(rows)
    pooled = S.pool_buckets(frame, "nll", 16)
    assert len(pooled) < len(frame) and set(pooled["stream"]) == {0, 1}
    for k, g in pooled.groupby("stream"):
        g = g.sort_values("position_start")
        width = np.diff([*g["position_start"], end[-1]])
        assert (width[:-1] >= 16).all()  # every pooled bucket but the last holds >= 16 positions
        raw = frame[frame["stream"] == k]
        w = (end - start).astype(float)
        want = (raw["nll"].to_numpy() * w).sum() / w.sum()
        got = (g["nll"].to_numpy() * width).sum() / width.sum()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_allclose(
            g["position"], np.sqrt(g["position_start"] * [*g["position_start"][1:], end[-1]])
        )
    assert S.pool_buckets(frame.drop(columns="position_start"), "nll", 16).equals(
        frame.drop(columns="position_start")
    )


def test_mode_ratios_pair_units_within_each_training():
    """Two trainings stream the same (seed, stream) units: each unit is paired with itself in its own
    training (not averaged across trainings), and the CI is hierarchical over the two."""
    rows = []
    for ck, gap in (("a", 0.0), ("b", 0.2)):  # training b: cache mode costs 0.2 nats more on every stream
        for stream in range(6):
            for mode, extra in (("original", 0.0), ("cache", gap)):
                rows.append({"strategy": "h2o", "strategy_label": "H2O", "strategy_order": 3, "evicts": True,
                             "budget": 64, "position_mode": mode, "checkpoint": ck, "seed": 0,
                             "stream": stream, "nll": 2.0 + 0.1 * stream + extra})  # fmt: skip
    frame = pd.DataFrame(rows)
    r = S.mode_ratios(frame).iloc[0]
    assert r["clusters"] == 2 and r["n"] == 12 and np.isclose(r["point"], np.exp(0.1))
    assert "2 trainings x 6 streams" in S.subject_caption(frame)
    assert "trainings" not in S.subject_caption(frame[frame["checkpoint"] == "a"])


def test_recall_table_counts_exact_answers_by_budget_and_depth():
    from evictlab.analysis.report import recall_table

    rows = []
    for strategy, evicts, budgets in (("full", False, [511]), ("window", True, [32, 64])):
        for budget in budgets:
            for depth in (0.1, 0.9):
                for k in range(2):
                    hit = (not evicts) or (budget == 64 and depth == 0.9 and k == 0)
                    ident = {"strategy": strategy, "strategy_label": strategy, "strategy_order": int(evicts)}
                    rows.append(ident | {"evicts": evicts, "budget": budget, "position_mode": "original",
                                         "depth": depth, "exact_teacher_forced": hit})  # fmt: skip
    t = recall_table({"recall": pd.DataFrame(rows)})
    assert list(t.columns) == ["all", "b32", "b64"] and list(t.index) == ["full", "window"]
    assert t.at["full", "all"] == "4/4 (2/2)" and t.at["full", "b32"] == "-"
    assert t.at["window", "b32"] == "0/4 (0/0)" and t.at["window", "b64"] == "1/4 (0/1)"


def test_training_table_has_a_column_per_training_and_a_hierarchical_one():
    from evictlab.analysis.report import training_table

    streams, results = [], []
    for ck, seed, cost in (("a", 0, 0.10), ("b", 1, 0.30)):
        for strategy, evicts, extra in (("full", False, 0.0), ("window", True, cost)):
            key = f"{strategy}-{ck}"
            ident = {
                "strategy": strategy,
                "strategy_label": strategy,
                "strategy_order": int(evicts),
                "evicts": evicts,
            }
            results.append(
                ident | {"run_key": key, "checkpoint": ck, "cfg.train.seed": seed, "metric": "ppl"}
            )
            for stream in range(8):
                nll = 2.0 + 0.05 * stream
                where = {"run_key": key, "checkpoint": ck, "budget": 64, "position_mode": "original"}
                streams.append(ident | where | {"stream": stream, "nll": nll + extra, "nll_full": nll})
    t = training_table({"streams": pd.DataFrame(streams), "results": pd.DataFrame(results)}, "original", 64)
    assert list(t.columns) == ["seed=0", "seed=1", "2 trainings"] and list(t.index) == ["window"]
    assert t.at["window", "seed=0"].startswith(f"{np.exp(0.1):.3f}")
    assert t.at["window", "2 trainings"].startswith(f"{np.exp(0.2):.3f}")  # the mean of the trainings' means
    # one row against another, paired per (training, stream): the window's perplexity / StreamingLLM's
    sinks = [r | {"strategy": "streaming_llm", "strategy_label": "StreamingLLM", "strategy_order": 2,
                  "run_key": r["run_key"] + "-s", "nll": r["nll"] - 0.05}
             for r in streams if r["strategy"] == "window"]  # fmt: skip
    res = results + [r | {"run_key": r["run_key"] + "-s", "strategy": "streaming_llm"} for r in results]
    both = {"streams": pd.DataFrame(streams + sinks), "results": pd.DataFrame(res)}
    vs = training_table(both, "original", 64, against="window")
    assert list(vs.index) == ["StreamingLLM"] and vs.at["StreamingLLM", "2 trainings"].startswith(
        f"{np.exp(0.05):.3f}"
    )
    with pytest.raises(ValueError, match="no row 'h2o'"):
        training_table(both, "original", 64, against="h2o")


def test_band_table_weights_buckets_by_their_width_and_merges_identical_modes():
    from evictlab.analysis.report import band_table

    curves, streams = [], []
    settings = [("full", False, "original", 1.0), ("full", False, "cache", 1.0),
                ("window", True, "original", 2.0), ("window", True, "cache", 3.0)]  # fmt: skip
    for strategy, evicts, mode, nll in settings:
        ident = {"strategy": strategy, "strategy_label": strategy, "strategy_order": int(evicts)}
        ident |= {"evicts": evicts, "budget": 64 if evicts else 1000, "position_mode": mode}
        # buckets [1, 4) and [4, 16): widths 3 and 12; the second band holds only the second bucket
        for start, end, value in ((1, 4, nll), (4, 16, nll + 1)):
            curves.append(
                ident | {"stream": 0, "position_start": start, "position": np.sqrt(start * end), "nll": value}
            )
        streams.append(ident | {"stream": 0, "nll": nll + 0.8})
    t = band_table({"curves": pd.DataFrame(curves), "streams": pd.DataFrame(streams)}, [4])
    assert list(t.columns) == ["budget", "mode", "perplexity", "1 - 3", "4 - 15"]  # the buckets' true edges
    assert list(t["mode"]) == ["both", "original", "cache"]  # the full cache is one row
    assert t.loc["window"].iloc[0]["1 - 3"] == "2.000" and t.loc["window"].iloc[1]["4 - 15"] == "4.000"
    # an edge inside a bucket: the band runs to the bucket's end, and says so
    cut_inside = band_table({"curves": pd.DataFrame(curves), "streams": pd.DataFrame(streams)}, [3])
    assert list(cut_inside.columns)[3:] == ["1 - 3", "4 - 15"]
    assert t.loc["full", "perplexity"] == f"{np.exp(1.8):.3f}"


def test_band_table_draws_the_full_cache_from_the_runs_reference_when_no_run_is_it():
    """A long-stream sweep has no full-cache run (its streams outrun the reference's cap): the table's full
    cache row comes from the reference the runs carry (nll_full), named with the cap, in both modes."""
    from evictlab.analysis.report import band_table

    curves, streams, results = [], [], []
    for budget, nll in ((64, 2.0), (256, 1.5)):
        ident = {"strategy": "window", "strategy_label": "window", "strategy_order": 1, "evicts": True}
        ident |= {"budget": budget, "position_mode": "cache", "run_key": f"w{budget}"}
        for start, end, full in ((1, 4, 1.0), (4, 16, 0.5), (16, 64, np.nan)):  # the cap inside [4, 16)
            curves.append(ident | {"stream": 0, "position_start": start, "position": np.sqrt(start * end),
                                   "nll": nll, "nll_full": full})  # fmt: skip
        streams.append(ident | {"stream": 0, "nll": nll, "nll_full": 0.7})
        results.append(ident | {"cfg.eval.full_max_len": 12})
    tables = {
        "curves": pd.DataFrame(curves),
        "streams": pd.DataFrame(streams),
        "results": pd.DataFrame(results),
    }
    t = band_table(tables, [4, 16])
    ref = "full cache (reference, first 12 predictions)"
    assert list(t.index) == [ref, "window", "window"]
    assert t.loc[ref, "mode"] == "both" and t.loc[ref, "budget"] == "-"
    assert t.loc[ref, "perplexity"] == f"{np.exp(0.7):.3f}"
    assert [t.loc[ref, c] for c in ("1 - 3", "4 - 15", "16 - 63")] == ["1.000", "0.500", "-"]


def test_band_costs_are_paired_on_the_predictions_the_reference_covers_with_a_t_interval_over_streams():
    """band_cost_table: per band, exp(mean over streams of the token-weighted NLL difference on the
    predictions both sides cover), its CI Student's t over few streams; a band the reference never
    reaches is "-"; the band's label names the covered span."""
    from scipy import stats

    from evictlab.analysis.report import band_cost_table

    ident = {"strategy": "window", "strategy_label": "window", "strategy_order": 1, "evicts": True}
    ident |= {"budget": 64, "position_mode": "cache", "run_key": "w"}
    curves, shifts = [], np.array([0.1, 0.3, 0.2])
    # [1, 4): 3 predictions, all covered; [4, 16): 12, the reference covers 5 (where the policy's mean is
    # nll_paired, not nll); [16, 64): none covered
    buckets = ((1, 4, 3, 3, 1.0, 1.0), (4, 16, 12, 5, 2.0, 1.5), (16, 64, 48, 0, 3.0, np.nan))
    for stream, shift in enumerate(shifts):
        for start, end, n, n_paired, nll, full in buckets:
            row = {"stream": stream, "position_start": start, "position": np.sqrt(start * end), "n": n}
            row |= {"nll": nll + shift if n == n_paired else nll, "nll_full": full, "n_paired": n_paired}
            curves.append(ident | row | {"nll_paired": nll + shift if n_paired else np.nan})
    tables = {"curves": pd.DataFrame(curves), "streams": pd.DataFrame([ident | {"stream": 0, "nll": 1.0}])}
    t = band_cost_table(tables, [4, 16])
    assert list(t.columns) == ["budget", "mode", "n", "1 - 3", "4 - 15"] and t.loc["window", "n"] == 3
    half = stats.t.ppf(0.975, 2) * shifts.std(ddof=1) / np.sqrt(3)
    low, high = np.exp(shifts.mean() - half), np.exp(shifts.mean() + half)
    assert t.loc["window", "1 - 3"] == f"{np.exp(shifts.mean()):.3f} [{low:.3f}, {high:.3f}]"
    paired = 2.0 + shifts - 1.5  # nll_paired - nll_full on [4, 16), whatever the uncovered predictions hold
    assert t.loc["window", "4 - 15"].startswith(f"{np.exp(paired.mean()):.3f} [")


def test_the_sinks_table_pairs_each_count_with_one_sink_on_the_same_streams_of_the_same_arm():
    from evictlab.analysis.report import sinks_table

    streams, results = [], []
    rng = np.random.default_rng(0)
    base = rng.normal(3.0, 0.5, size=6)  # per stream: what varies between streams, shared by every count
    for bos in (True, False):
        for n_sink, shift in ((1, 0.0), (4, -0.05), (0, 1.0)):
            key = f"{bos}-{n_sink}"
            results.append({"run_key": key, "cfg.strategy.params.n_sink": n_sink, "cfg.dataset.bos": bos})
            for i, b in enumerate(base):
                nll = b + shift + (0.02 if bos else 0.0) + (0.01 if i == 5 and n_sink == 4 else 0.0)
                streams.append(
                    {"run_key": key, "stream": i, "strategy": "streaming_llm", "evicts": True, "budget": 64}
                    | {"position_mode": "original", "nll": nll, "checkpoint": f"ck-{bos}"}
                )
    t = sinks_table({"streams": pd.DataFrame(streams), "results": pd.DataFrame(results)})
    assert list(t.columns) == ["BOS, original", "no BOS, original"] and list(t.index) == [0, 1, 4]
    # 4 sinks: 0.05 nats lower on 5 streams, 0.04 on the last: paired, the streams' spread cancels
    assert (
        t.loc[4, "BOS, original"].startswith(f"{np.exp(-0.29 / 6):.3f} [")
        and t.loc[4].str.endswith("; 6/6").all()
    )
    assert t.loc[1, "no BOS, original"] == "1.000 [1.000, 1.000]; 0/6"
    assert t.loc[0, "BOS, original"].startswith(f"{np.exp(1.0):.3f}")


def test_overlapping_tick_labels_finds_crowded_labels_and_passes_clean_ones():
    with F.style():
        fig, ax = F._subplots(figsize=(3, 2))
        ax.set_xticks(range(30), [f"layer {i}" for i in range(30)])
        assert ("layer 0", "layer 1") in F.overlapping_tick_labels(fig)
        fig, ax = F._subplots(figsize=(3, 2))
        ax.set_xticks(range(0, 30, 10), ["0", "10", "20"])
        ax.set_xlim(-1, 30)
        assert F.overlapping_tick_labels(fig) == []
        fig, ax = F._subplots(figsize=(3, 2))  # rotated: crowded only when closer than the text is high
        ax.set_xticks(range(60), [f"L{i}" for i in range(60)], rotation=45)
        assert F.overlapping_tick_labels(fig)
        ax.set_xticks(range(0, 60, 12), [f"L{i}" for i in range(0, 60, 12)], rotation=45)
        assert F.overlapping_tick_labels(fig) == []


def _minor_labels_in_view(fig, ax) -> set[str]:
    fig.canvas.draw()
    low, high = ax.get_ylim()
    pairs = zip(ax.yaxis.get_minorticklocs(), ax.yaxis.get_minorticklabels(), strict=False)
    return {t.get_text() for loc, t in pairs if low <= loc <= high and t.get_text()}


def test_a_log_axis_labels_only_the_minor_ticks_that_fit():
    with F.style():
        fig, ax = F._subplots(figsize=(4, 3))
        ax.plot([0, 1], [0.95, 300])  # 2.5 decades: powers of ten, then 2 and 5 only; never 0.9 under 1
        F._log_y(ax)
        shown = _minor_labels_in_view(fig, ax)
        assert shown and shown <= {"2", "5", "20", "50", "200"}
        assert F.overlapping_tick_labels(fig) == []
        fig, ax = F._subplots(figsize=(4, 3))
        ax.plot([0, 1], [1.0, 1.9])  # within a decade: every minor tick
        F._log_y(ax)
        assert {"1.2", "1.4", "1.6", "1.8"} <= _minor_labels_in_view(fig, ax)


def test_figures_register_where_defined_and_drawing_sets_no_global_backend(tmp_path: Path):
    """Importing the figures, drawing one and saving it as PNG and PDF leaves matplotlib's backend
    unresolved (a notebook's own stays), and keeps no figure in pyplot's list."""
    code = (
        "import matplotlib, sys; import evictlab.analysis.figures as F; "
        "fig, ax = F._subplots(figsize=(2, 2)); ax.plot([1, 2]); "
        f"fig.savefig(r'{tmp_path}/a.png'); fig.savefig(r'{tmp_path}/a.pdf'); "
        "import matplotlib.pyplot as plt; "
        "print(matplotlib.rcParams._get_backend_or_none(), plt.get_fignums(), len(F.FIGURES))"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["None", "[]", str(len(F.FIGURES))]
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "a.pdf").stat().st_size > 0
    for name, spec in F.FIGURES.items():  # each entry is the module's function of that name
        assert callable(getattr(F, name)) and spec.draw.__qualname__.startswith("figure.")


def test_runs_of_one_policy_that_differ_in_a_setting_are_rows_and_lines_of_their_own():
    """The recompute window with n_sink 0 and 4 (one strategy name): the band tables give each its row,
    paired on its own predictions (a sampled run's nll_full holds the reference only where it scored),
    and nll_vs_position draws each; pooled, the two would average into one row that is neither."""
    from evictlab.analysis import stats as S
    from evictlab.analysis.report import band_cost_table, band_table

    curves, streams, results = [], [], []
    for key, strategy, n_sink, cost in (("s", "streaming_llm", 4, 0.2), ("r0", "recompute_window", 0, 0.5),
                                        ("r4", "recompute_window", 4, 0.1)):  # fmt: skip
        ident = {"strategy": strategy, "strategy_label": strategy, "strategy_order": 2 + (strategy != "s")}
        ident |= {"evicts": True, "budget": 64, "position_mode": "cache", "run_key": key}
        results.append(ident | {"cfg.strategy.params.n_sink": n_sink})
        for stream in range(3):
            for start, end in ((1, 4), (4, 16)):
                full = 1.0 + 0.1 * stream
                row = {"stream": stream, "position_start": start, "position": np.sqrt(start * end)}
                row |= {"n": 2, "n_paired": 2, "nll_full": full, "nll": full + cost + 0.01 * stream}
                curves.append(ident | row | {"nll_paired": row["nll"]})
            streams.append(ident | {"stream": stream, "nll": 1.0 + cost, "nll_full": 1.0})
    tables = {
        "curves": pd.DataFrame(curves),
        "streams": pd.DataFrame(streams),
        "results": pd.DataFrame(results),
    }
    split = S.split_settings(tables["streams"], tables["results"])
    assert set(split["strategy"]) == {
        "streaming_llm",
        "recompute_window (n_sink=0)",
        "recompute_window (n_sink=4)",
    }
    assert S.split_settings(tables["streams"], None) is tables["streams"]  # nothing to tell apart by
    t = band_cost_table(tables, [4])
    assert list(t.index) == ["streaming_llm", "recompute_window (n_sink=0)", "recompute_window (n_sink=4)"]
    assert t.loc["recompute_window (n_sink=0)", "1 - 3"].startswith(f"{np.exp(0.51):.3f} [")
    assert t.loc["recompute_window (n_sink=4)", "4 - 15"].startswith(f"{np.exp(0.11):.3f} [")
    bands = band_table(tables, [4])
    assert bands.loc["recompute_window (n_sink=4)", "1 - 3"] == f"{1.0 + 0.1 + 0.1 + 0.01:.3f}"
    fig = F.draw("nll_vs_position", tables, budget=64, mode="cache")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"recompute_window (n_sink=0)", "recompute_window (n_sink=4)", "streaming_llm"} <= set(labels)
    direct = F.nll_vs_position(tables["curves"], 64, mode="cache")  # without results: one pooled line
    assert "recompute_window" in direct.axes[0].get_legend_handles_labels()[1]


def test_an_arms_runs_that_differ_in_a_parameter_are_told_apart_in_every_table():
    """One arm (conf/arm/) run in every layer and in one layer at a time: `setting_labels` names each run
    "arm, layer=k", and the tables that keep settings apart (`split_settings`) give each its own row,
    so an ablation in one layer is never pooled with the same ablation in all of them."""
    from evictlab.analysis.report import cost_table

    results, streams = [], []
    for key, layer, cost in (("all", None, 0.4), ("l0", 0, 0.3), ("l1", 1, 0.05)):
        ident = {"strategy": "bos_ablation", "strategy_label": "BOS ablated", "strategy_order": 20}
        ident |= {"evicts": True, "budget": 64, "position_mode": "original", "run_key": key}
        results.append(ident | {"cfg.arm": "bos_key", "cfg.strategy.params.layer": layer})
        streams += [ident | {"stream": s, "nll": 1.0 + cost + 0.01 * s, "nll_full": 1.0} for s in range(3)]
    results = pd.DataFrame(results)
    labels = S.setting_labels(results)
    assert labels.to_dict() == {"all": "bos_key", "l0": "bos_key, layer=0", "l1": "bos_key, layer=1"}
    assert set(S.run_labels(results)) == {"bos_key"}  # the arm alone cannot tell them apart
    split = S.split_settings(pd.DataFrame(streams), results)
    assert split.groupby("strategy")["nll"].mean().round(3).to_dict() == {
        "bos_ablation (bos_key)": 1.41,
        "bos_ablation (bos_key, layer=0)": 1.31,
        "bos_ablation (bos_key, layer=1)": 1.06,
    }
    t = cost_table({"streams": pd.DataFrame(streams), "results": results})
    rows = ["BOS ablated (bos_key)", "BOS ablated (bos_key, layer=0)", "BOS ablated (bos_key, layer=1)"]
    assert list(t.index) == rows
    assert t.loc[rows[2], "b64"].startswith(f"{np.exp(1.06):.2f} ({np.exp(0.06):.3f} [")


def test_band_costs_set_against_one_policy_pair_a_sampled_run_through_the_full_cache():
    """StreamingLLM scores every prediction, a sampled recompute run only some, and harder ones (the full
    cache's NLL is higher there): set against each other by band, each side's difference to the full cache
    on its own predictions is what is compared, so how hard the sampled predictions are cancels; against a
    run that covers the same predictions it is their plain paired difference."""
    from evictlab.analysis.report import band_cost_table

    curves, results = [], []
    runs = (("s", "streaming_llm", 0.0, 0.2), ("r", "recompute_window", 1.0, 0.1), ("w", "window", 0.0, 0.6))
    for key, strategy, harder, cost in runs:
        ident = {"strategy": strategy, "strategy_label": strategy.replace("_", " ")}
        ident |= {"strategy_order": len(results)}
        ident |= {"evicts": True, "budget": 64, "position_mode": "cache", "run_key": key}
        results.append(ident)
        for stream in range(4):
            for start, n in ((1, 3), (4, 12)):
                full = 1.0 + 0.1 * stream + harder
                nll = full + cost + (0.02 * stream if key == "w" else 0.0)
                row = {"stream": stream, "position_start": start, "n": n}
                row["position"] = np.sqrt(start * (start + n))  # (a log bucket's centre)
                curves.append(ident | row | {"n_paired": n, "nll_full": full, "nll": nll, "nll_paired": nll})
    tables = {"curves": pd.DataFrame(curves), "results": pd.DataFrame(results)}
    t = band_cost_table(tables, [4], against="streaming llm")  # (a label, as figures.yaml names rows)
    assert list(t.index) == ["recompute window", "window"]
    same = f"{np.exp(0.1):.3f}"  # every stream 0.2 - 0.1 (not 1.2 - 2.1: the sampled ones are harder)
    assert t.loc["recompute window", "4 - 15"] == f"{same} [{same}, {same}]"
    window = t.loc["window", "1 - 3"]  # 0.2 - (0.6 + 0.02 x stream) per stream: mean -0.43, t-interval
    d = np.array([0.2 - 0.6 - 0.02 * s for s in range(4)])
    half = 3.182446 * d.std(ddof=1) / 2  # t(0.975, 3 df) x standard error over 4 streams
    low, high = np.exp(d.mean() - half), np.exp(d.mean() + half)
    assert window == f"{np.exp(d.mean()):.3f} [{low:.3f}, {high:.3f}]"
    with pytest.raises(ValueError, match="no row 'TOVA'"):
        band_cost_table(tables, [4], against="TOVA")
