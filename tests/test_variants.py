"""Training variants (conf/variant/): each is one recipe, a sweep over them skips invalid combinations,
and the analysis draws one row / bar group per variant."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from evictlab.analysis import figures as F
from evictlab.analysis import stats as S
from evictlab.analysis.aggregate import aggregate, wide
from evictlab.analysis.report import headline_table, load_tables
from evictlab.config import CONF_DIR, compose, to_objects
from evictlab.store import REPO_ROOT
from tests.test_analysis import with_facts
from tests.test_pipeline import cfg_for

VARIANTS = sorted(p.stem for p in (CONF_DIR / "variant").glob("*.yaml"))


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_composes_names_itself_and_changes_the_recipe(name):
    # on the experiment's base: gpt_small, train=short (400 steps)
    base = to_objects(compose(["train=short", "variant=base"]))
    cfg = to_objects(compose(["train=short", f"variant={name}"]))
    assert cfg.variant == name
    changed = [k for k in ("model", "dataset", "train") if getattr(cfg, k) != getattr(base, k)]
    assert bool(changed) == (name != "base"), changed  # every variant but the base changes the recipe
    assert cfg.strategy == base.strategy and cfg.eval == base.eval  # never the evaluation


def test_variant_overrides_the_groups_and_the_command_line_overrides_the_variant(outputs: Path):
    cfg = cfg_for(outputs, "variant=steps800")
    assert cfg.train.steps == 800 and cfg.train.seq_len == 64  # on top of train=tiny
    assert cfg_for(outputs, "variant=steps800", "train.steps=50").train.steps == 50


@pytest.fixture(scope="module")
def variant_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    outputs = tmp_path_factory.mktemp("variants") / "outputs"
    env = {**os.environ, "EVICTLAB_OUTPUTS": str(outputs)}
    cmd = [
        sys.executable, "-m", "evictlab.run", "-m", "+experiment=sink_emergence", "hydra/launcher=basic",
        "logger=none", "model=gpt_tiny", "train=tiny", "train.progress=false", "eval.n_streams=2",
        "eval.stream_len=96", "budget=b16", "seed=0", "strategy=full,window", "variant=base,learned_pos",
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    return outputs / "runs" / "sink_emergence", res


def test_sweep_skips_invalid_combinations_and_runs_the_rest(variant_sweep):
    sweep, res = variant_sweep
    assert res.returncode == 0, res.stderr
    # learned absolute positions have no cache position mode: 2 strategies x cache skipped, not failed
    assert res.stderr.count("skipped (not a valid combination)") == 2
    metrics = [json.loads(p.read_text()) for p in sweep.rglob("metrics.json")]
    assert len(metrics) == 6 and all(m["status"] == "ok" for m in metrics)
    assert sorted((m["variant"], m["position_mode"]) for m in metrics if m["strategy"] == "window") == [
        ("base", "cache"), ("base", "original"), ("learned_pos", "original")]  # fmt: skip
    ckpts = {m["checkpoint"] for m in metrics}
    assert len(ckpts) == 2  # one model per variant, shared by its runs


def test_a_sweep_without_skip_invalid_still_fails_loudly(outputs: Path):
    env = {**os.environ, "EVICTLAB_OUTPUTS": str(outputs)}
    cmd = [sys.executable, "-m", "evictlab.run", "model=gpt_tiny", "train=tiny", "variant=learned_pos",
           "eval.position_mode=cache", "logger=none"]  # fmt: skip
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.startswith("error: eval.position_mode=cache needs RoPE")


def test_variant_figures_and_headline(variant_sweep, tmp_path: Path):
    sweep, _ = variant_sweep
    aggregate([sweep], sweep)
    tables = load_tables(sweep)
    runs = wide(tables["results"])
    assert set(runs["variant"]) == {"base", "learned_pos"}
    mass = S.layer_values(tables["layers"], "first_position_mass")
    assert mass.groupby("variant")["head"].nunique().to_dict() == {"base": 4, "learned_pos": 4}  # gpt_tiny
    figs = F.draw_all(tables)
    assert {"sink_by_variant", "eviction_by_variant", "ppl_vs_budget"} <= set(figs)
    # the per-policy figures show the base model only: they never average different models
    heat = figs["sink_by_variant"].axes[0]
    assert [t.get_text() for t in heat.get_yticklabels()] == ["base", "learned_pos"]
    bars = figs["eviction_by_variant"].axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["base", "learned_pos"]
    head = headline_table(tables)
    assert "variant" in head and set(head["variant"]) == {"base", "learned_pos"}


def test_eviction_by_variant_is_the_paired_ratio_to_the_full_cache():
    rows = []
    for v, gap in (("base", 0.0), ("sinky", 0.5)):
        for s in range(20):
            rows += [{"variant": v, "strategy": "window", "position_mode": "original", "budget": 64,
                      "stream": s, "seed": 0, "nll": 1.0 + gap + 0.01 * s, "nll_full": 1.0 + 0.01 * s},
                     {"variant": v, "strategy": "streaming_llm", "position_mode": "original", "budget": 64,
                      "stream": s, "seed": 0, "nll": 1.0 + 0.01 * s, "nll_full": 1.0 + 0.01 * s}]  # fmt: skip
    fig = F.eviction_by_variant(with_facts(pd.DataFrame(rows)))
    points = {c.get_label(): c.lines[0].get_ydata().tolist() for c in fig.axes[0].containers}
    assert points["window (original)"] == pytest.approx([1.0, math.exp(0.5)])  # worse on the sinky model
    assert points["StreamingLLM (original)"] == pytest.approx([1.0, 1.0])


def _variant_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """(layers, runs) of three variants: 3 layers x 4 heads; head (l, h) gets mass 0.01 * (l * 4 + h) *
    scale in the full-cache run."""
    runs, layers = [], []
    for variant, scale, gap in (("steps200", 1.0, 1.00), ("base", 2.0, 1.05), ("steps800", 4.0, 1.20)):
        for strategy, ppl in (("full", 3.0), ("window", 3.0 * gap), ("streaming_llm", 3.0)):
            runs.append({"variant": variant, "strategy": strategy, "position_mode": "original", "ppl": ppl})
        layers += [{"variant": variant, "strategy": "full", "position_mode": "original", "layer": i // 4,
                    "head": i % 4, "metric": "first_position_mass", "value": 0.01 * i * scale}
                   for i in range(12)]  # fmt: skip
    layers = pd.DataFrame(layers).sample(frac=1, random_state=0)  # row order must not matter
    return with_facts(layers), with_facts(pd.DataFrame(runs))


def test_first_position_mass_is_layers_by_heads():
    mass = S.first_position_mass(_variant_tables()[0])
    assert set(mass) == {"steps200", "base", "steps800"}
    assert mass["base"].shape == (3, 4)
    assert mass["base"][2, 3] == pytest.approx(0.01 * 11 * 2.0)  # [11] is layer 2 head 3, not after [1]
    assert mass["steps200"][0].tolist() == pytest.approx([0.0, 0.01, 0.02, 0.03])


def test_sink_trend_plots_mass_and_ppl_ratio_against_the_knob():
    layers, runs = _variant_tables()
    fig = F.sink_trend(layers, runs, {"training steps": {"steps200": 200, "base": 400, "steps800": 800}})
    top, bottom = fig.axes[0], fig.axes[1]
    strongest = top.get_lines()[0]
    assert strongest.get_xdata().tolist() == [200, 400, 800]
    assert strongest.get_ydata().tolist() == pytest.approx([11.0, 22.0, 44.0])
    window = next(ln for ln in bottom.get_lines() if ln.get_label() == "window")
    assert window.get_ydata().tolist() == pytest.approx([1.0, 1.05, 1.2])


def test_variant_table_has_one_row_per_variant(variant_sweep):
    from evictlab.analysis.report import variant_table

    sweep, _ = variant_sweep
    aggregate([sweep], sweep)
    t = variant_table(load_tables(sweep))
    assert list(t["variant"]) == ["base", "learned_pos"]
    assert t.loc[1, "window (cache) / full"] == "-"  # learned positions: no cache mode
    assert "StreamingLLM (original) / full" not in t  # the arms are the ones the sweep ran
    assert t.loc[0, "window (original) / full"].count("[") == 1 and t["full-cache ppl"].gt(1).all()


def test_report_finds_the_scale_knobs_of_the_committed_sink_sweep():
    from evictlab import paper

    tables = paper.load_snapshot(paper.EXPERIMENTS / "sink_emergence")
    axes = F.trend_axes(tables["results"])
    # variants that differ from base in one number only, with at least two of them per knob
    assert axes == {"model.n_layer": {"base": 4, "layers2": 2, "layers8": 8},
                    "train.steps": {"base": 400, "steps200": 200, "steps800": 800},
                    "train.synthetic_share": {"base": 0.0, "syn25": 0.25, "syn50": 0.5},
                    "train.weight_decay": {"base": 0.1, "wd05": 0.5, "wd_high": 1.0}}  # fmt: skip
    assert {"sink_by_variant", "eviction_by_variant", "sink_trend"} <= set(F.draw_all(tables))
    two = F.trend_axes(tables["results"], min_points=2)  # knobs with one variant beside base too
    assert two["model.n_head"] == {"base": 4, "heads8": 8}
    assert two["train.recall_share"] == {"base": 0.0, "recall_mix": 0.3}


def test_sink_trend_draws_a_knob_with_zero_on_a_linear_axis():
    layers, runs = _variant_tables()
    fig = F.sink_trend(layers, runs, {"synthetic share": {"base": 0.0, "steps200": 0.25, "steps800": 0.5}})
    top = fig.axes[0]
    assert top.get_xscale() == "linear"
    assert top.get_lines()[0].get_xdata().tolist() == [0.0, 0.25, 0.5]
    steps = F.sink_trend(layers, runs, {"training steps": {"steps200": 200, "base": 400, "steps800": 800}})
    assert steps.axes[0].get_xscale() == "log"
