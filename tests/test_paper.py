"""`make figures`: every experiments/<name>/ figure is redrawn from its committed snapshot."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evictlab import paper
from tests.test_configs import grid


def test_every_experiment_folder_is_complete():
    folders = paper.experiment_folders()
    assert {f.name for f in folders} >= {"streaming_quality", "position_modes"}
    for folder in folders:
        spec = paper.load_spec(folder)
        assert (paper.REPO_ROOT / "conf" / "experiment" / f"{spec['experiment']}.yaml").exists()
        assert (folder / "README.md").exists()
        for table in ("results", "streams", "curves"):
            assert (folder / "snapshot" / f"{table}.parquet").exists(), (folder.name, table)
        assert sum(p.stat().st_size for p in (folder / "snapshot").iterdir()) < 2_000_000  # small


def test_make_figures_redraws_every_paper_figure_with_no_tick_labels_overlapping(tmp_path: Path, monkeypatch):
    real, overlaps = paper.F.draw, {}

    def checked(name, tables, **args):  # inside paper.draw's style block, as the figure is saved
        fig = real(name, tables, **args)
        overlaps[name] = overlaps.get(name, []) + paper.F.overlapping_tick_labels(fig)
        return fig

    monkeypatch.setattr(paper.F, "draw", checked)
    assert paper.main(["figures", "--out", str(tmp_path)]) == 0
    assert len(overlaps) >= 10 and not {k: v for k, v in overlaps.items() if v}
    for folder in paper.experiment_folders():
        for fig in paper.load_spec(folder)["figures"]:
            stem = fig.get("file", fig["name"])
            for ext in ("png", "pdf"):
                f = tmp_path / folder.name / f"{stem}.{ext}"
                assert f.exists() and f.stat().st_size > 5000, f


def test_snapshots_are_real_sweeps():
    """The snapshots hold finished runs of the experiment they claim (not hand-made numbers)."""
    for folder in paper.experiment_folders():
        spec = paper.load_spec(folder)
        res = paper.load_snapshot(folder)["results"]
        assert set(res["group"]) == {spec["experiment"]}
        strategies = set()
        for exp in paper.experiments(spec):
            strategies |= {strategy_of(point, exp) for point in grid(exp)}
        if spec.get("in_progress"):  # made in slices, some still to run: what it holds is from the grid
            assert set(res["strategy"]) < strategies, f"{folder.name}: complete? drop in_progress"
        else:
            assert set(res["strategy"]) == strategies
        assert res["run_key"].str.fullmatch(r"[0-9a-f]{16}").all()


def strategy_of(point: list[str], experiment: str) -> str:
    """The policy a grid point runs: its `strategy=`, else the one its `arm=` selects (conf/arm/), else the
    experiment's own."""
    import yaml

    for o in point:
        if o.startswith("strategy="):
            return o.removeprefix("strategy=")
    for o in point:
        if o.startswith("arm="):
            arm = yaml.safe_load(
                (paper.REPO_ROOT / "conf" / "arm" / f"{o.removeprefix('arm=')}.yaml").read_text()
            )
            for entry in arm.get("defaults", []):
                if isinstance(entry, dict) and "override /strategy" in entry:
                    return entry["override /strategy"]
    return base_strategy(experiment)


def base_strategy(experiment: str) -> str:
    from evictlab.config import compose

    return compose([f"+experiment={experiment}"]).strategy.name


def test_bad_spec_and_unknown_folder(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "figures.yaml").write_text("experiment: default\nfigures:\n  - {name: pie_chart}\n")
    with pytest.raises(ValueError, match="unknown figure"):
        paper.load_spec(tmp_path / "x")
    assert paper.main(["figures", "--only", "nope"]) == 2
    assert "no experiments" in capsys.readouterr().err


def test_make_paper_refreshes_the_snapshot_from_the_sweep(tmp_path: Path, monkeypatch):
    """`make paper` runs `make sweep EXP=<experiment>` and copies that sweep's aggregated tables into
    the folder's snapshot; here the sweep is simulated by copying the committed tables."""
    import shutil

    src = paper.EXPERIMENTS / "position_modes"
    exp = paper.load_spec(src)["experiment"]  # (the sweep the folder's figures read)
    folder = tmp_path / "experiments" / "position_modes"
    shutil.copytree(src, folder)
    for f in (folder / "snapshot").iterdir():
        f.unlink()
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("EVICTLAB_OUTPUTS", str(outputs))
    calls = []

    def fake_make(cmd, cwd, check):
        calls.append(cmd)
        sweep = outputs / "runs" / exp
        sweep.mkdir(parents=True, exist_ok=True)
        for t in ("results", "streams", "curves"):
            shutil.copyfile(src / "snapshot" / f"{t}.parquet", sweep / f"{t}.parquet")

    monkeypatch.setattr(paper.subprocess, "run", fake_make)
    monkeypatch.setattr(paper, "EXPERIMENTS", tmp_path / "experiments")
    assert paper.main(["run", "--launcher", "submitit_local", "--out", str(tmp_path / "figs")]) == 0
    assert calls == [["make", "sweep", f"EXP={exp}", f"GROUP={exp}", "LAUNCHER=submitit_local"]]
    assert {p.name for p in (folder / "snapshot").iterdir()} == {
        "results.parquet",
        "streams.parquet",
        "curves.parquet",
    }
    assert (tmp_path / "figs" / "position_modes" / "position_modes.png").exists()


def test_make_paper_by_slices_merges_each_slice_into_the_committed_snapshot(tmp_path: Path, monkeypatch):
    """`paper run --slice B`: only experiment B's sweep runs; its runs replace their own rows in the
    committed snapshot (matched by run_key), slice A's rows stay, and a committed run that streamed
    other text than the slice (a re-made experiment's old runs) goes. An unknown slice is an error."""
    folder = tmp_path / "experiments" / "sliced"
    (folder / "snapshot").mkdir(parents=True)
    (folder / "figures.yaml").write_text(
        "experiment: exp_a\nalso: [exp_b]\nlauncher: local_serial\nfigures: []\n"
    )
    old = pd.DataFrame(
        {
            "run_key": ["a1", "a2", "b1", "z9"],
            "nll": [1.0, 2.0, 3.0, 9.0],
            "streams_sha256": ["t", "t", "t", "u"],
        }
    )
    old.to_parquet(folder / "snapshot" / "results.parquet", index=False)
    pd.DataFrame({"run_key": ["a1"], "stream": [0]}).to_parquet(folder / "snapshot" / "streams.parquet")
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("EVICTLAB_OUTPUTS", str(outputs))
    calls = []

    def fake_make(cmd, cwd, check):
        calls.append(cmd)
        sweep = outputs / "runs" / "exp_a"  # every slice's runs land in the first experiment's group
        sweep.mkdir(parents=True, exist_ok=True)
        new = pd.DataFrame({"run_key": ["b1", "b2"], "nll": [3.5, 4.0], "streams_sha256": ["t", "t"]})
        new.to_parquet(sweep / "results.parquet", index=False)

    monkeypatch.setattr(paper.subprocess, "run", fake_make)
    monkeypatch.setattr(paper, "EXPERIMENTS", tmp_path / "experiments")
    monkeypatch.setattr(paper, "draw", lambda folder, out: [])  # (tables here are not real results)
    argv = ["run", "--only", "sliced", "--slice", "exp_b", "--out", str(tmp_path / "figs")]
    assert paper.main(argv) == 0
    assert calls == [["make", "sweep", "EXP=exp_b", "GROUP=exp_a", "LAUNCHER=local_serial"]]  # its own
    got = pd.read_parquet(folder / "snapshot" / "results.parquet").set_index("run_key")["nll"]
    assert got.to_dict() == {"a1": 1.0, "a2": 2.0, "b1": 3.5, "b2": 4.0}  # z9 streamed other text: dropped
    # a table the slice did not make is kept as committed
    assert pd.read_parquet(folder / "snapshot" / "streams.parquet")["run_key"].tolist() == ["a1"]
    with pytest.raises(ValueError, match="exp_c"):
        paper.main(["run", "--only", "sliced", "--slice", "exp_c"])


@pytest.mark.slow
def test_verify_holds_on_the_smollm2_snapshot_and_fails_on_one_perturbed_by_one_percent(
    smollm2_outputs: Path,
):
    """make verify's comparison on a committed SmolLM2 snapshot (one stream of each sampled run here, to fit
    CI: `make verify EXP=smollm2_quality` streams all 16), then the same measurements against a copy of the
    snapshot whose NLL is 1% off (or whose agreement is off by 1% of the tokens)."""
    from evictlab import results as R
    from evictlab import verify as V

    folder = paper.EXPERIMENTS / "smollm2_quality"
    experiment = paper.load_spec(folder)["experiment"]
    now, notes = V.rerun(folder, experiment, streams=1, outputs=smollm2_outputs)
    snapshot = R.read_tables(folder / "snapshot")["streams"]
    policies = set(snapshot["strategy"])
    assert {run.split()[0] for run in now["run"]} == policies  # one run per policy
    rows = V.compare(snapshot, now)
    assert rows["ok"].all(), V.report(rows) + "\n" + "\n".join(notes)
    assert set(rows["metric"]) == {"nll", "nll_full", "kl", "agree", "correct"}
    # NLL 1% off; agreement 1% off, or by 1% of the tokens where 1% of it is inside ABS_TOL (L2Norm's ~0.2)
    agree = snapshot["agree"]
    agree_off = (agree * 1.01).where(0.01 * agree > V.ABS_TOL, agree + 0.01)
    for metric, moved in (("nll", snapshot["nll"] * 1.01), ("agree", agree_off)):
        off = V.compare(snapshot.assign(**{metric: moved}), now)
        assert not off.loc[off["metric"] == metric, "ok"].any(), metric
        assert off.loc[off["metric"] != metric, "ok"].all()


def test_verify_lets_a_value_deciding_policy_move_by_a_flipped_decision_but_not_by_one_percent():
    """TOVA's numbers may move by a decision that float rounding flips on another CPU (0.13% measured,
    verify.py's docstring); the window's may not (its decisions are positions); neither may move by 1%."""
    from evictlab import verify as V

    snapshot = pd.DataFrame(
        {"run_key": ["t", "w"], "stream": [0, 0], "strategy": ["tova", "window"]}
        | {"nll": [3.0865, 3.3308], "nll_full": [1.75, 1.75], "kl": [0.7953, 2.4394]}
        | {"agree": [0.68, 0.44], "correct": [0.43, 0.31]}
    )

    def now(scale: float) -> pd.DataFrame:
        moved = snapshot.assign(nll=snapshot["nll"] * scale, kl=snapshot["kl"] + 0.0036)
        return moved.drop(columns="strategy").assign(run=["tova b64", "window b64"])

    flipped = V.compare(snapshot, now(1.0013)).set_index(["run", "metric"])["ok"]
    assert flipped["tova b64", "nll"] and flipped["tova b64", "kl"]
    assert not flipped["window b64", "nll"] and not flipped["window b64", "kl"]
    assert not V.compare(snapshot, now(1.01)).set_index(["run", "metric"])["ok"]["tova b64", "nll"]
    # which decide by values: the scorers, not the window, the sinks, random (hashes of positions), the
    # window with re-computation (no cache: its windows are positions) or the full cache
    assert [V.decides(n) for n in ("tova", "h2o", "l2norm", "scissorhands", "oracle")] == [True] * 5
    names = ("window", "streaming_llm", "random", "recompute_window", "full", "nope")
    assert not any(V.decides(n) for n in names)


def test_verify_notes_no_difference_between_a_recorded_value_and_its_enum():
    """The snapshot records a config's enums by value ('rope'); the composed config holds the enum."""
    from evictlab import results as R
    from evictlab import verify as V
    from evictlab.config import compose, to_objects

    results = R.read_tables(paper.EXPERIMENTS / "smollm2_quality" / "snapshot")["results"]
    (h2o,) = [s for s in V.sample_runs(results, "smollm2_quality") if s.label.startswith("h2o")]
    cfg = to_objects(compose([*h2o.overrides, "logger=none"]))
    notes = V.config_differences(cfg, h2o.recorded)
    assert not [n for n in notes if "model." in n or "eval." in n or "dataset." in n], notes


def test_verify_needs_a_known_experiment(capsys):
    assert paper.main(["verify"]) == 2
    assert "error: verify needs --only NAME" in capsys.readouterr().err
    assert paper.main(["verify", "--only", "no_such_experiment"]) == 2
    assert "no_such_experiment" in capsys.readouterr().err
    assert paper.main(["verify", "--only", "smollm2_quality", "--streams", "0"]) == 2
    assert "--streams 0 must be >= 1" in capsys.readouterr().err


def test_the_verify_sample_is_one_run_per_policy_and_arm_at_the_middle_budget_in_original_positions():
    """One run per policy and per value of a setting its runs differ in besides budget, positions and
    seeds (a policy parameter, BOS in the text)."""
    from evictlab import results as R
    from evictlab import verify as V

    results = R.read_tables(paper.EXPERIMENTS / "smollm2_quality" / "snapshot")["results"]
    sample = V.sample_runs(results, "smollm2_quality")
    labels = sorted(s.label for s in sample)
    assert labels == sorted(
        ["full b1023 original", "window b64 original", "streaming_llm b64 original", "h2o b64 original"]
        + ["tova b64 original", "scissorhands b64 original", "l2norm b64 original", "random b64 original"]
        + ["oracle b64 original", "recompute_window b64 original n_sink=0"]
        + ["recompute_window b64 original n_sink=1"]
    )
    recompute = [s for s in sample if s.label.startswith("recompute_window")]
    assert {o for s in recompute for o in s.overrides if "n_sink" in o} == {
        "strategy.params.n_sink=0",
        "strategy.params.n_sink=1",
    }
    sinks = R.read_tables(paper.EXPERIMENTS / "smollm2_sinks" / "snapshot")["results"]
    arms = {s.label for s in V.sample_runs(sinks, "smollm2_sinks")}  # both BOS arms x every sink count
    n_sinks = sorted(sinks["cfg.strategy.params.n_sink"].unique())
    assert arms == {
        f"streaming_llm b64 original bos={b} n_sink={n}" for b in ("true", "false") for n in n_sinks
    }
    # runs of the imported model from before train.threads was checked recorded 0: not passed on
    assert not [o for s in sample for o in s.overrides if o.startswith("train.")]
    h2o = next(s for s in sample if s.label.startswith("h2o"))
    assert h2o.overrides[:3] == ["+experiment=smollm2_quality", "strategy=h2o", "budget=b64"]
    assert "eval.position_mode=original" in h2o.overrides
    assert len(V.sample_runs(results, "smollm2_quality", every=True)) == results["run_key"].nunique()
    # a group choice every run shares is passed on too (compose does not read the sweep's grid: a budget
    # left out composed as the experiment's default, and verify compared another budget's numbers)
    tasks = R.read_tables(paper.EXPERIMENTS / "smollm2_tasks" / "snapshot")["results"]
    chosen = tasks.drop_duplicates("run_key").set_index("run_key")
    for s in V.sample_runs(tasks, "smollm2_tasks"):
        row = chosen.loc[s.run_key]
        assert s.overrides[1:3] == [f"strategy={row['strategy']}", f"budget={row['cfg.budget.name']}"]


# experiments whose README quotes its snapshot's tables (`make tables EXP=NAME`), and the READMEs that
# together quote them (the paper subject's sweep is shared by two folders)
QUOTED_TABLES = {
    "smollm2_quality": ["smollm2_quality"],
    "ablations": ["ablations"],
    "streaming_quality": ["streaming_quality", "position_modes"],
    "smollm2_recall": ["smollm2_recall"],
    "recall": ["recall"],
    "long_stream": ["long_stream"],
    "smollm2_long": ["smollm2_long"],
    "smollm2_sinks": ["smollm2_sinks"],
    "smollm2_tasks": ["smollm2_tasks"],
    "smollm2_generation": ["smollm2_generation"],
}


def test_tables_print_a_snapshot_of_several_stream_lengths_once_per_length(capsys):
    """long_stream holds 65,536- and 2^20-token runs: each length gets its own tables (one cell never pools
    runs of two lengths)."""
    assert paper.main(["tables", "--only", "long_stream"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == [
        "## long_stream, streams of 65,536 predictions",
        "## long_stream, streams of 1,048,576 predictions",
    ]
    assert "CIs over 4 stream(s)" in out and "CIs over 1 stream(s)" in out


@pytest.mark.parametrize("name", sorted(QUOTED_TABLES))
def test_readme_numbers_are_the_snapshots_tables(name, capsys):
    """Every cell of the printed tables is in the experiment's README, so a README cannot drift from its
    snapshot (or quote one its snapshot no longer supports)."""
    assert paper.main(["tables", "--only", name]) == 0
    out = capsys.readouterr().out
    cells = [c.strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line
             for c in line.strip("|").split("|")[1:]]  # fmt: skip
    cells = [c for c in cells if c != "-" and not c.startswith("b")]
    assert len(cells) >= 8
    readme = "\n".join(
        (paper.REPO_ROOT / "experiments" / f / "README.md").read_text() for f in QUOTED_TABLES[name]
    )
    missing = [c for c in cells if c not in readme]
    assert not missing, f"{name}/README.md lacks {missing[:3]} (make tables EXP={name})"


def test_verify_names_in_one_line_what_a_snapshots_provenance_lacks():
    """Every run records its commit (in main's history), the sha256 of its streams and of its weights, and
    every stream its documents; `provenance_gaps` says what is missing, None when nothing is."""
    from evictlab import verify as V

    git = ["git", "-C", str(paper.REPO_ROOT), "rev-parse", "HEAD"]
    head = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    results = pd.DataFrame(
        {"run_key": ["a", "a", "b"], "info.git_commit": [head, head, head[:7]]}
        | {"streams_sha256": ["s", "s", "s"], "weights_sha256": ["w", "w", "w"]}
    )
    streams = pd.DataFrame(
        {"run_key": ["a", "b"], "stream": [0, 0], "documents": ["man1/ls.1.gz", "x@3 | y"]}
    )
    assert V.provenance_gaps({"results": results, "streams": streams}, paper.REPO_ROOT) is None
    holes = results.assign(streams_sha256=["s", "s", None], **{"info.git_commit": [head, head, "9cecf2f"]})
    holes = {"results": holes.drop(columns="weights_sha256"), "streams": streams.iloc[:, :2]}
    line = V.provenance_gaps(holes, paper.REPO_ROOT)
    assert line == (
        "1 of 2 runs lack streams_sha256; 2 of 2 runs lack weights_sha256; commit 9cecf2f (1 runs) is not in "
        "main's history; 2 of 2 streams lack their documents"
    )
    # re-made on the pinned text: complete; made before it: the holes a reviewer found are the ones named
    for name in ("smollm2_recall", "smollm2_quality", "smollm2_sinks", "smollm2_tasks"):
        gaps = V.provenance_gaps(paper.load_snapshot(paper.EXPERIMENTS / name), paper.REPO_ROOT)
        assert gaps is None or V.shallow(paper.REPO_ROOT), gaps  # (a shallow clone cannot see the commits)


def test_decision_noise_is_measured_under_rounding_level_perturbations_and_sets_the_tolerance():
    """`paper noise`: the weights moved by about one unit in the last place (seeded) give the shifts of each
    value-deciding run; verify then allows NOISE_FACTOR x that shift to such a run, and only to it."""
    import torch

    from evictlab import verify as V
    from evictlab.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(name="t", vocab_size=40, n_layer=2, n_head=2, n_embd=16)).eval()
    a, b = V.perturbed(model, 0), V.perturbed(model, 0)
    for p, q, r in zip(model.parameters(), a.parameters(), b.parameters(), strict=True):
        assert torch.equal(q, r) and (not torch.equal(p, q) or (p == 0).all())  # seeded; moved, but a zero
        rel = ((q - p).abs() / p.abs().clamp(min=1e-30))[p != 0]
        assert (rel <= 8 * torch.finfo(p.dtype).eps).all()
    assert not torch.equal(next(V.perturbed(model, 1).parameters()), next(a.parameters()))

    frame = {"run_key": ["t", "t", "w"], "run": ["tova b64", "tova b64", "window b64"], "stream": [0, 1, 0]}
    plain = pd.DataFrame(frame | {"nll": [3.0, 2.0, 3.3], "agree": [0.6, 0.7, 0.5]})
    moved = [plain.assign(nll=[3.003, 2.0, 3.3], agree=[0.6, 0.69, 0.5]), plain.assign(nll=[3.0, 2.004, 3.3])]
    noise = V.noise_table(plain, moved)
    got = noise.set_index(["run_key", "metric"])["noise"]
    assert got["t", "nll"] == pytest.approx(0.002) and got["t", "agree"] == pytest.approx(0.01)
    assert got["w", "nll"] == 0 and set(noise["perturbations"]) == {2}
    snapshot = plain.assign(strategy=["tova", "tova", "window"], nll_full=1.5, kl=0.5, correct=0.4)
    now = plain.assign(nll=[3.0 * 1.0035, 2.0, 3.3])  # 0.35%: within 2 x 0.2% measured for TOVA only
    rows = V.compare(snapshot, now.assign(nll_full=1.5, kl=0.5, correct=0.4), noise).set_index(
        ["run", "metric"]
    )
    assert rows.loc[("tova b64", "nll"), "ok"].all()
    too_far = now.assign(nll=[3.0 * 1.005, 2.0, 3.3], nll_full=1.5, kl=0.5, correct=0.4)
    assert not V.compare(snapshot, too_far, noise)["ok"].all()
    moved_window = now.assign(nll=[3.0, 2.0, 3.3 * 1.0035], nll_full=1.5, kl=0.5, correct=0.4)
    assert not V.compare(snapshot, moved_window, noise)["ok"].all()  # position-only: no noise allowed
    # a measured noise below DECISION_TOL (H2O's: ~1e-7) never narrows that floor, which another CPU set
    calm = noise.assign(noise=0.0)
    nll = lambda f: [3.0 * f, 2.0, 3.3]  # noqa: E731
    ok = V.compare(snapshot, now.assign(nll=nll(1.0015), nll_full=1.5, kl=0.5, correct=0.4), calm)
    assert ok.loc[ok["metric"] == "nll", "ok"].all()
    off = V.compare(snapshot, now.assign(nll=nll(1.0025), nll_full=1.5, kl=0.5, correct=0.4), calm)
    assert not off.loc[off["metric"] == "nll", "ok"].all()


def test_a_one_model_snapshot_prints_its_against_rows_paired_per_stream():
    """figures.yaml `tables: {against: [row]}` on a snapshot of one model: that row's perplexity over each
    other policy's, paired stream by stream, one column per budget."""
    tables = paper.load_snapshot(paper.EXPERIMENTS / "smollm2_recall")
    out = paper._tables_text("smollm2_recall", tables, {"against": ["StreamingLLM"]})
    block = out[out.index("StreamingLLM against each other policy") :].split("\n\n")[0]
    assert "| policy | b32 | b64 | b128 | b256 |" in block
    s = tables["streams"][tables["streams"]["budget"] == 64].set_index(["strategy", "stream"])["nll"]
    ratio = np.exp((s["streaming_llm"] - s["h2o"]).mean())
    row = next(line for line in block.splitlines() if line.startswith("| h2o |"))
    assert row.split("|")[3].strip().startswith(f"{ratio:.3f} [")
    # a run that scored sampled steps only (window + recompute) is set against the row through the full
    # cache: each side's cost against it on its own predictions, never their plain NLLs (other tokens)
    from evictlab.analysis import stats as S

    quality = paper.load_snapshot(paper.EXPERIMENTS / "smollm2_quality")
    out = paper._tables_text("smollm2_quality", quality, {"against": ["StreamingLLM"]})
    block = out[out.index("StreamingLLM against each other policy") :].split("\n\n")[0]
    q = quality["streams"]
    q = q[(q["budget"] == 64) & (q["position_mode"] == "original")].set_index(["run_key", "stream"])
    labels = S.setting_labels(quality["results"])
    recompute = next(
        k for k in S.sampled_runs(quality["results"]) & set(q.index.levels[0]) if labels[k] == "n_sink=0"
    )
    sinks = q[q["strategy"] == "streaming_llm"].index[0][0]
    cost = q["nll"] - q["nll_full"]
    through_full = np.exp((cost[sinks] - cost[recompute]).mean())
    row = next(line for line in block.splitlines() if line.startswith("| window+recompute (n_sink=0) |"))
    assert row.split("|")[3].strip().startswith(f"{through_full:.3f} [")
    assert abs(np.exp((q["nll"][sinks] - q["nll"][recompute]).mean()) - through_full) > 0.01  # other tokens
    # where the reference is capped (smollm2_long: 12,288 of 32,768 predictions) a sampled run is left out
    assert not paper.reference_capped(quality["results"])
    assert paper.reference_capped(paper.load_snapshot(paper.EXPERIMENTS / "smollm2_long")["results"])


def test_the_band_table_says_what_a_sampled_runs_plain_columns_cover():
    """smollm2_long's re-computed window scored 128 sampled predictions per stream: its plain perplexity and
    band NLLs sit beside the others' means over every prediction, so the table says so (a snapshot without
    sampled runs gets no such line)."""
    text = paper.snapshot_tables(paper.EXPERIMENTS / "smollm2_long")
    band = text[text.index("mean NLL [nats] by position band") : text.index("paired cost by position band")]
    assert "over its 128 sampled predictions per stream" in band
    assert paper._sampled_note(paper.load_snapshot(paper.EXPERIMENTS / "smollm2_recall")["results"]) == []


def _deciding_sample(where: Path):
    """The value-deciding runs verify samples from an experiment folder's snapshot (what `make noise`
    re-runs), and each snapshot run's number of streams (by run_key)."""
    from evictlab import results as R
    from evictlab import verify as V

    results = R.read_tables(where / "snapshot")["results"]
    runs = results.drop_duplicates("run_key").set_index("run_key")
    sample = V.sample_runs(results, paper.load_spec(where)["experiment"])
    return [s for s in sample if V.decides(runs.loc[s.run_key, "strategy"])], runs["n_streams"]


@pytest.mark.parametrize(
    "folder", sorted(p.parent.name for p in paper.EXPERIMENTS.glob("*/decision_noise.csv"))
)
def test_a_committed_decision_noise_covers_its_snapshots_value_deciding_runs(folder):
    """verify looks a run's measured noise up by run_key: a snapshot re-made without `make noise` again would
    silently fall back to the floor (and fail on another CPU). Each committed decision_noise.csv names
    exactly the value-deciding runs verify samples from its snapshot, over all their streams, 3 seeds."""
    from evictlab import verify as V

    where = paper.EXPERIMENTS / folder
    sample, n = _deciding_sample(where)
    noise = pd.read_csv(where / V.NOISE_FILE)
    assert set(noise["run_key"]) == {s.run_key for s in sample}
    assert (noise["streams"] == noise["run_key"].map(n)).all() and set(noise["perturbations"]) == {3}


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in paper.EXPERIMENTS.glob("*/noise_runs")))
def test_committed_noise_runs_recompute_their_decision_noise(folder):
    """A noise measurement made over sessions keeps each (pass, run) in experiments/<name>/noise_runs/,
    committed as it comes: each file is one pass of one value-deciding sampled run of the snapshot over all
    its streams, named by both; once every pass of every such run is there, the committed
    decision_noise.csv is what `noise_table` makes of them (to the CSV's 6 digits). (Part of the passes: a
    measurement under way.)"""
    from evictlab import verify as V

    where = paper.EXPERIMENTS / folder
    sample, n = _deciding_sample(where)
    passes = ["plain", *(f"perturbed(seed={s})" for s in range(3))]
    expected = {V.kept_path(where, None, s, None, p).name: (s, p) for s in sample for p in passes}
    runs = {p.name: pd.read_parquet(p) for p in sorted((where / V.NOISE_RUNS).glob("*.parquet"))}
    assert runs and set(runs) <= set(expected), sorted(set(runs) - set(expected))
    for name, frame in runs.items():
        s, label = expected[name]
        assert set(frame["run_key"]) == {s.run_key} and set(frame["noise_pass"]) == {label}
        assert sorted(frame["stream"]) == list(range(int(n[s.run_key]))) and frame["machine"].notna().all()
    if set(runs) != set(expected):
        return  # a measurement under way: the CSV is made when its last pass is in
    frame = pd.concat(runs.values(), ignore_index=True)
    by_pass = {k: g.drop(columns="noise_pass") for k, g in frame.groupby("noise_pass")}
    again = V.noise_table(by_pass["plain"], [by_pass[p] for p in passes[1:]])
    again = again.set_index(["run_key", "metric"])["noise"]
    got = pd.read_csv(where / V.NOISE_FILE).set_index(["run_key", "metric"])["noise"]
    assert set(again.index) == set(got.index)
    np.testing.assert_allclose(again[got.index].to_numpy(), got.to_numpy(), rtol=1e-5, atol=1e-12)
