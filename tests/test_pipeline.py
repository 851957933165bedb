"""The pipeline: run files, resume, failures, W&B offline read-back, sweeps, bad configs, reproducibility."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evictlab import run as run_mod
from evictlab.config import compose, to_objects
from evictlab.store import REPO_ROOT
from tests.conftest import run_cli
from tests.wandb_reader import read_run

FAST = ["model=gpt_tiny", "train=tiny", "train.progress=false", "eval.n_streams=2", "eval.stream_len=96"]


def cfg_for(outputs: Path, *overrides: str):
    return to_objects(compose([*FAST, f"paths.outputs={outputs}", *overrides]))


def ok_runs(outputs: Path) -> dict[str, dict]:
    out = {}
    for m in (outputs / "runs").rglob("metrics.json"):
        d = json.loads(m.read_text())
        if d["status"] == "ok":
            out[m.parent.name] = d
    return out


def test_run_writes_its_files_and_resumes(outputs: Path):
    cfg = cfg_for(outputs, "strategy=h2o", "budget=b16", "logger=none")
    metrics = run_mod.run(cfg)
    d = run_mod.run_dir(cfg)
    assert d.name.startswith("h2o-b16-") and d.parent.name == "adhoc"
    files = {p.name for p in d.iterdir()}
    assert files == {
        "config.yaml",
        "run_info.json",
        "per_token.parquet",
        "layers.parquet",
        "attention.parquet",
        "metrics.json",
    }
    assert metrics["status"] == "ok" and metrics["run_key"] == run_mod.run_key(cfg)
    frame = pd.read_parquet(d / "per_token.parquet")
    assert len(frame) == 2 * 95 and {"stream", "position", "nll", "kl", "agree", "lost_mean"} <= set(frame)
    attn = pd.read_parquet(d / "attention.parquet")
    assert len(attn) == 2 * 95 and attn["layer"].nunique() == 2  # gpt_tiny: 2 layers x 95 key positions
    assert (attn["attention"] > 0).all() and attn.loc[attn["key_position"] == 94, "attention"].notna().all()
    info = json.loads((d / "run_info.json").read_text())
    assert {"git", "packages", "host", "slurm_job_id", "torch", "cpu_capability", "python"} <= set(info)
    assert info["torch_threads"] == cfg.eval.threads  # the count the run used, not the process default
    assert info["model_config"]["n_layer"] == cfg.model.n_layer and info["model_config"]["name"] == "gpt_tiny"
    ck_meta = json.loads((outputs / "checkpoints" / metrics["checkpoint"] / "meta.json").read_text())
    assert metrics["weights_sha256"] == ck_meta["weights_sha256"]  # the run names the weights it measured
    # every key a run emits is documented in docs/results.md
    doc = (REPO_ROOT / "docs" / "results.md").read_text()
    layers = pd.read_parquet(d / "layers.parquet")
    emitted = set(metrics) | set(frame) | set(layers["metric"]) | set(info)
    undocumented = {
        k for k in emitted if f"`{k}`" not in doc and not k.startswith(("lost_l", "first4_mass_l"))
    }
    assert not undocumented, f"not in docs/results.md: {sorted(undocumented)}"
    mtime = (d / "metrics.json").stat().st_mtime_ns
    again = run_mod.run(cfg_for(outputs, "strategy=h2o", "budget=b16", "logger=none"))
    assert again["skipped"] and (d / "metrics.json").stat().st_mtime_ns == mtime
    # locks (run, checkpoint, caches) sit in hidden .locks/ folders, not beside the results they guard
    assert not [p for p in outputs.rglob("*.lock") if p.parent.name != ".locks"]
    assert (d.parent / ".locks" / f"{d.name}.lock").exists()


def test_the_analysis_stage_loads_neither_torch_nor_hydra():
    code = (
        "import sys, evictlab.analysis.aggregate, evictlab.analysis.report, evictlab.paper; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'omegaconf'}); "
        "heavy += [m for m in ('evictlab.run', 'evictlab.config') if m in sys.modules]; print(heavy)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_run_key_ignores_logging_and_threads_but_not_results(outputs: Path):
    base = run_mod.run_key(cfg_for(outputs, "strategy=window"))
    assert base == run_mod.run_key(
        cfg_for(outputs / "elsewhere", "strategy=window", "logger=none", "eval.threads=2")
    )
    assert base != run_mod.run_key(cfg_for(outputs, "strategy=window", "seed=1"))
    assert base != run_mod.run_key(cfg_for(outputs, "strategy=window", "budget=b16"))
    # the full cache ignores the budget, so every budget maps to one run
    assert run_mod.run_key(cfg_for(outputs, "budget=b16")) == run_mod.run_key(cfg_for(outputs, "budget=b32"))


def test_runs_of_a_sweep_share_the_full_cache_reference(outputs: Path):
    """Two runs on one checkpoint and the same streams: the second reads the first's full-cache log-probs
    from outputs/cache/references (diagnostics off), and says so in metrics.json."""
    args = ("budget=b16", "logger=none", "eval.diagnostics=false", "group=shared")
    first = run_mod.run(cfg_for(outputs, "strategy=h2o", *args))
    second = run_mod.run(cfg_for(outputs, "strategy=window", *args))
    assert (first["full_reference_shared"], second["full_reference_shared"]) == (0, 1)
    assert len(list((outputs / "cache" / "references").glob("*.safetensors"))) == 1
    assert first["ppl_full"] == second["ppl_full"]
    # eval.share_reference=false: the run computes its own (in no key: the same run, the same numbers)
    alone = run_mod.run(cfg_for(outputs / "alone", "strategy=window", *args, "eval.share_reference=false"))
    assert alone["full_reference_shared"] == 0 and alone["ppl_full"] == second["ppl_full"]
    assert not (outputs / "alone" / "cache" / "references").exists()


def test_a_failed_run_records_the_error_and_reraises(outputs: Path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated crash in the engine")

    monkeypatch.setattr(run_mod, "evaluate", boom)
    cfg = cfg_for(outputs, "strategy=window", "logger=none")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_mod.run(cfg)
    m = json.loads((run_mod.run_dir(cfg) / "metrics.json").read_text())
    assert m["status"] == "failed" and "simulated crash" in m["error"] and "Traceback" in m["traceback"]
    assert not ok_runs(outputs)
    monkeypatch.undo()
    assert run_mod.run(cfg)["status"] == "ok"  # a failed run is retried on the next call


def test_offline_wandb_run_holds_config_tags_and_metrics(outputs: Path):
    cfg = cfg_for(outputs, "strategy=streaming_llm", "budget=b16")
    metrics = run_mod.run(cfg)
    files = list((outputs / "wandb").glob(f"offline-run-*-{metrics['run_key']}/run-*.wandb"))
    assert len(files) == 1
    wb = read_run(files[0])
    assert wb["id"] == metrics["run_key"] and wb["job_type"] == "eval" and wb["group"] == "adhoc"
    assert set(wb["tags"]) == {
        "strategy:streaming_llm", "budget:b16", "model:gpt_tiny", "dataset:pydoc_topics",
        "position_mode:original",
    }  # fmt: skip
    assert wb["config"]["strategy"] == {"name": "streaming_llm", "params": {"n_sink": 4, "first_sink": 0}}
    assert wb["config"]["budget"]["tokens"] == 16 and wb["config"]["seed"] == 0
    for key in ("ppl", "ppl_second_half", "kl_mean", "agreement", "kv_bytes", "token_steps_per_s"):
        assert wb["summary"][key] == pytest.approx(metrics[key]), key
    assert any("nll_by_position/nrows" in h for h in wb["history"])
    # the training run that produced the checkpoint was logged once, with its loss curve
    train = list((outputs / "wandb").glob("offline-run-*-train-*/run-*.wandb"))
    assert len(train) == 1
    twb = read_run(train[0])
    assert twb["job_type"] == "train" and len([h for h in twb["history"] if "train_loss" in h]) == 60


def test_wandb_that_cannot_start_does_not_fail_the_run(outputs: Path, monkeypatch, capsys):
    import wandb

    def no_network(*a, **k):
        raise wandb.errors.CommError("could not reach api.wandb.ai")

    monkeypatch.setattr(wandb, "init", no_network)
    metrics = run_mod.run(cfg_for(outputs, "strategy=window", "logger=wandb_online"))
    assert metrics["status"] == "ok"
    err = capsys.readouterr().err
    assert err.count("W&B could not start") >= 1 and "the run continues locally" in err


def test_same_config_and_seed_bit_identical_across_processes(outputs: Path):
    args = [*FAST, "strategy=h2o", "budget=b16", "logger=none", "seed=3"]
    a = run_cli("evictlab.run", *args, "group=a", outputs=outputs)
    b = run_cli("evictlab.run", *args, "group=b", outputs=outputs)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    pa = next((outputs / "runs" / "a").glob("h2o-*/per_token.parquet"))
    pb = next((outputs / "runs" / "b").glob("h2o-*/per_token.parquet"))
    fa, fb = pd.read_parquet(pa), pd.read_parquet(pb)
    assert (fa["nll"].to_numpy() == fb["nll"].to_numpy()).all()
    c = run_cli(
        "evictlab.run",
        *FAST,
        "strategy=h2o",
        "budget=b16",
        "logger=none",
        "seed=4",
        "group=c",
        outputs=outputs,
    )
    assert c.returncode == 0
    fc = pd.read_parquet(next((outputs / "runs" / "c").glob("h2o-*/per_token.parquet")))
    assert not (fc["nll"].to_numpy() == fa["nll"].to_numpy()).all()  # another seed: other text


BAD = [
    ("unknown-strategy", ["strategy=belady"], "strategy/belady"),
    ("unknown-budget-option", ["budget=b7"], "budget/b7"),
    ("budget-zero", ["budget.tokens=0"], "budget.tokens=0"),
    ("budget-negative", ["budget.tokens=-8"], "budget.tokens=-8"),
    ("fraction-above-one", ["budget=frac1_2", "budget.fraction=1.5"], "budget.fraction=1.5"),
    ("non-integer-seed", ["seed=1.5"], "seed"),
    ("n-sink-ge-budget", ["strategy=streaming_llm", "budget=b16", "strategy.params.n_sink=16"], "n_sink=16"),
    ("missing-text-path", ["dataset=text_files", "dataset.path=/nonexistent/x.txt"], "dataset.path"),
    ("cache-mode-learned", ["model.pos_emb=learned", "eval.position_mode=cache"], "position_mode=cache"),
    ("cuda-without-gpu", ["eval.device=cuda"], "eval.device=cuda"),
    ("experiment-missing", ["+experiment=nope"], "experiment/nope"),
    ("unknown-strategy-param", ["strategy=h2o", "+strategy.params.heavy=3"], "heavy"),
    ("h2o-split", ["strategy=h2o", "budget=b16", "strategy.params.recent_fraction=0.99"], "h2o split"),
    ("zero-streams", ["eval.n_streams=0"], "eval.n_streams=0"),
    ("bad-position-mode", ["eval.position_mode=rotary"], "position_mode"),
    (
        "stream-too-long",
        ["strategy=window", "eval.stream_source=documents", "eval.stream_len=100000"],
        "longer than the documents",
    ),
    (
        "stream-longer-than-the-split",
        ["strategy=window", "eval.stream_len=2000000"],
        "they hold",
    ),
    ("hf-without-path", ["model=hf"], "model.name_or_path"),
    (
        "hf-missing-folder",
        ["model=hf", "model.name_or_path=/nonexistent/ckpt"],
        "not a folder with a config.json",
    ),
    ("bad-dtype", ["model.dtype=float8"], "model.dtype"),
]


@pytest.mark.parametrize("overrides, expect", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_configs_fail_in_one_line(overrides, expect, outputs: Path):
    res = run_cli("evictlab.run", *FAST, "logger=none", *overrides, outputs=outputs)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and expect in lines[0], res.stderr
    if lines[0].startswith("error: "):
        assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert not (outputs / "runs").exists() or not ok_runs(outputs)


def _sweep(outputs: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "EVICTLAB_OUTPUTS": str(outputs)}
    return subprocess.Popen(
        [sys.executable, "-m", "evictlab.run", "-m", "+experiment=smoke", "logger=none", *extra],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.slow
def test_killed_sweep_resumes_and_every_run_ends_ok_once(outputs: Path):
    proc = _sweep(outputs, "hydra/launcher=basic")
    deadline = time.time() + 240
    while len(ok_runs(outputs)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {
        k: (outputs / "runs" / "smoke" / k / "metrics.json").stat().st_mtime_ns for k in ok_runs(outputs)
    }
    assert 3 <= len(before) < 7
    for bad in (outputs / "runs").rglob("*.tmp"):  # a temp file may remain; it is never read as a result
        assert not bad.name.endswith(".json")
    again = _sweep(outputs, "hydra/launcher=basic")
    log, _ = again.communicate(timeout=300)
    assert again.returncode == 0, log
    assert "runs already finished: not launched" in log  # only the missing runs reached the launcher
    done = ok_runs(outputs)
    assert len(done) == 7  # 4 strategies x 2 budgets, full counted once
    for k, mtime in before.items():  # finished runs were not redone
        assert (outputs / "runs" / "smoke" / k / "metrics.json").stat().st_mtime_ns == mtime
    third = _sweep(outputs, "hydra/launcher=basic")
    log, _ = third.communicate(timeout=300)
    # a finished sweep launches no job at all, and counts runs as aggregation does (the full cache's one run
    # serves both budgets' jobs)
    assert third.returncode == 0 and "7 of 7 runs already finished: not launched (8 jobs" in log, log
    assert ": already done" not in log and "#0 :" not in log


@pytest.mark.slow
def test_submitit_local_sweep_takes_the_slurm_code_path(outputs: Path):
    grid = ["strategy=window,h2o", "budget=b16,b32"]  # the command line wins over the experiment's sweep
    proc = _sweep(outputs, "hydra/launcher=submitit_local", *grid)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    done = ok_runs(outputs)
    assert len(done) == 4
    # submitit ran each job in its own process and left its logs: the path a SLURM array takes
    assert len(list((outputs / "hydra" / "sweeps" / "smoke").rglob("*_submitted.pkl"))) >= 4
    assert len({d["run_key"] for d in done.values()}) == 4
    # four jobs needed one checkpoint: it was trained once
    assert len(list((outputs / "checkpoints").glob("gpt_tiny-*/meta.json"))) == 1


def test_a_run_past_the_reference_cap_records_its_metrics_as_absent_and_still_draws(outputs: Path):
    from evictlab.analysis import figures as F
    from evictlab.analysis.aggregate import aggregate
    from evictlab.analysis.report import load_tables

    for strategy in ("window", "h2o"):
        cfg = cfg_for(outputs, f"strategy={strategy}", "budget=b16", "logger=none", "eval.full_max_len=40")
        m = run_mod.run(cfg)
        assert m["full_reference_len"] == 40 and m["ppl_full"] > 1 and 0 <= m["agreement"] <= 1
        pt = pd.read_parquet(run_mod.run_dir(cfg) / "per_token.parquet")
        covered = pt["position"] <= 40
        for col in ("nll_full", "kl", "agree", "lost_mean", "first4_mass_mean"):
            assert pt.loc[covered, col].notna().all() and pt.loc[~covered, col].isna().all(), (strategy, col)
        assert pt["nll"].notna().all()
    sweep = outputs / "runs" / "adhoc"
    aggregate([sweep], sweep)
    tables = load_tables(sweep)
    figs = F.draw_all(tables)
    assert {"ppl_vs_budget", "kl_vs_budget", "nll_vs_position"} <= set(figs)
    # a stream's cost against the full cache compares the same predictions: those the reference covers
    s = tables["streams"].iloc[0]
    runs = {d.name.split("-")[0]: d for d in sweep.iterdir() if (d / "per_token.parquet").exists()}
    pt = pd.read_parquet(runs[s["strategy"]] / "per_token.parquet")
    mine = pt[pt["stream"] == s["stream"]]
    assert np.isclose(s["nll_paired"], mine.loc[mine["position"] <= 40, "nll"].mean())
    assert np.isclose(s["nll"], mine["nll"].mean()) and not np.isclose(s["nll_paired"], s["nll"])
    from evictlab.analysis import stats as S

    assert np.isclose(S.paired_delta(tables["streams"]).iloc[0], s["nll_paired"] - s["nll_full"])
    # no curve bucket straddles the cap: each holds only covered or only uncovered predictions, counted
    c = tables["curves"]
    c = c[(c["run_key"] == s["run_key"]) & (c["stream"] == s["stream"])].sort_values("position_start")
    assert 41 in set(c["position_start"]) and (c["n_paired"].isin([0]) | (c["n_paired"] == c["n"])).all()
    assert c["n"].sum() == len(mine) and c["n_paired"].sum() == 40
    inside = c[c["n_paired"] > 0]
    assert np.isclose((inside["nll_paired"] * inside["n"]).sum() / 40, s["nll_paired"])


@pytest.mark.parametrize(
    "damage",
    ["truncate per_token.parquet", "delete per_token.parquet", "garble config.yaml", "delete layers.parquet"],
)
def test_a_finished_run_with_damaged_files_is_listed_then_redone(outputs: Path, damage: str):
    from evictlab.analysis.aggregate import aggregate

    cfg = cfg_for(outputs, "strategy=window", "budget=b16", "logger=none")
    run_mod.run(cfg)
    d = run_mod.run_dir(cfg)
    verb, name = damage.split(" ")
    if verb == "truncate":
        (d / name).write_bytes((d / name).read_bytes()[:100])
    elif verb == "delete":
        (d / name).unlink()
    else:
        (d / name).write_text("strategy: [unclosed\n")
    assert not run_mod.is_done(d)
    t = aggregate([d.parent])  # never crashes on one bad run folder: it lists it with the reason
    row = t["failures"].set_index("run_dir").loc[str(d)]
    assert row["status"] == "unreadable" and (name in row["error"] or "Error" in row["error"]), row["error"]
    again = run_mod.run(cfg)  # redone in place, same key
    assert not again.get("skipped") and run_mod.is_done(d) and again["run_key"] == run_mod.run_key(cfg)
    assert aggregate([d.parent])["failures"].empty


def test_a_run_of_weights_since_replaced_is_redone_and_aggregation_refuses_a_mix(outputs: Path, capsys):
    import shutil

    import torch

    from evictlab.analysis.aggregate import aggregate
    from evictlab.analysis.aggregate import main as aggregate_main
    from evictlab.checkpoints import load_checkpoint, save_checkpoint
    from evictlab.errors import ConfigError
    from evictlab.store import read_json, write_json

    cfg = cfg_for(outputs, "strategy=window", "budget=b16", "logger=none")
    first = run_mod.run(cfg)
    d = run_mod.run_dir(cfg)
    # a copy of the finished run under another key: the old weights' record, as a stale run would be
    stale = d.parent / f"window-b16-{'0' * 16}"
    shutil.copytree(d, stale)
    # the checkpoint is replaced under the same name (as a retraining under an unchanged key would)
    ck = outputs / "checkpoints" / first["checkpoint"]
    model, meta = load_checkpoint(ck)
    with torch.no_grad():
        model.wte.weight.mul_(1.01)
    save_checkpoint(ck, model, {k: v for k, v in meta.items() if k != "weights_sha256"})
    new_hash = read_json(ck / "meta.json")["weights_sha256"]
    assert new_hash != first["weights_sha256"] and not run_mod.is_done(d)
    again = run_mod.run(cfg)  # redone in place, and it names the new weights
    assert not again.get("skipped") and again["weights_sha256"] == new_hash and run_mod.is_done(d)
    with pytest.raises(ConfigError, match=r"stands for 2 sets of weights"):
        aggregate([d.parent])
    assert aggregate_main([str(d.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and len(err.strip().splitlines()) == 1
    shutil.rmtree(stale)
    assert aggregate_main([str(d.parent)]) == 0
    out = capsys.readouterr().out
    assert f"gpt_tiny ({first['checkpoint']}, weights sha256 {new_hash[:12]}...) on " in out
    assert "warning" not in out
    commit = read_json(d / "run_info.json")["git"]["commit"]
    assert f"evictlab commit {str(commit)[:12]}" in out  # the commit the runs ran at
    # a sweep that mixes models says so (the runs' metrics as another model's would be)
    other = d.parent / f"window-b16-{'1' * 16}"
    shutil.copytree(d, other)
    m = read_json(other / "metrics.json")
    write_json(other / "metrics.json", m | {"run_key": "1" * 16, "model": "gpt_other", "checkpoint": "x"})
    assert aggregate_main([str(d.parent)]) == 0
    assert "warning: this sweep mixes models (gpt_other, gpt_tiny)" in capsys.readouterr().out.replace(
        "(gpt_tiny, gpt_other)", "(gpt_other, gpt_tiny)"
    )


def test_a_sigterm_records_the_run_as_failed_and_the_rerun_completes_it(outputs: Path):
    """SLURM sends SIGTERM before it kills a job: the run stops, says so in metrics.json (status failed), is
    not done, and running it again completes it."""
    args = [*FAST, "strategy=h2o", "budget=b16", "eval.stream_len=2048", "eval.n_streams=4", "logger=none"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")} | {
        "EVICTLAB_OUTPUTS": str(outputs)
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "evictlab.run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    cfg = cfg_for(outputs, *args[len(FAST) :])
    d = run_mod.run_dir(cfg)
    deadline = time.time() + 120
    while not (d / "run_info.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)  # inside the run (training the tiny model, or evaluating)
    assert proc.poll() is None, "the run ended before it could be terminated"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    m = json.loads((d / "metrics.json").read_text())
    assert m["status"] == "failed" and "Terminated: terminated by SIGTERM" in m["error"], out.decode()[-2000:]
    assert not run_mod.is_done(d)
    again = run_mod.run(cfg)
    assert again["status"] == "ok" and not again.get("skipped") and run_mod.is_done(d)


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_that_runs_failure_not_the_sweeps(outputs: Path):
    """As the out-of-memory killer would: every process that starts the target run is killed with SIGKILL.
    The other runs finish, the target is recorded as failed, the sweep ends with one summary line, exit 1."""
    grid = ["strategy=h2o", "budget=b16", "eval.n_streams=2,3,4,24"]  # the 24-stream run is the target
    run_cli("evictlab.train", "+experiment=smoke", "logger=none", outputs=outputs)  # the checkpoint first
    proc = _sweep(outputs, "hydra/launcher=local", *grid)
    killed: set[int] = set()
    while proc.poll() is None:
        for info in (outputs / "runs" / "smoke").glob("h2o-*/run_info.json"):
            run = info.parent
            if "n_streams: 24" not in (run / "config.yaml").read_text() or (run / "metrics.json").exists():
                continue
            try:
                pid = json.loads(info.read_text())["pid"]
            except (ValueError, OSError):  # being written
                continue
            if pid not in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    log = proc.stdout.read()
    assert proc.returncode == 1, log
    assert killed, log
    summary = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    assert len(summary) == 1 and "1 of 4 runs failed" in summary[0] and "eval.n_streams=24" in summary[0], log
    assert "its process died" in summary[0] and "Traceback" not in log
    done = ok_runs(outputs)
    assert sorted(m["n_streams"] for m in done.values()) == [2, 3, 4]
    failed = [
        json.loads(p.read_text())
        for p in (outputs / "runs" / "smoke").glob("*/metrics.json")
        if json.loads(p.read_text())["status"] == "failed"
    ]
    assert len(failed) == 1 and failed[0]["error"].startswith("KilledError: its process died")
    # aggregate lists it with the reason
    from evictlab.analysis.aggregate import aggregate

    sweep = outputs / "runs" / "smoke"
    aggregate([sweep], sweep)
    failures = pd.read_csv(sweep / "failures.csv")
    assert "KilledError" in " ".join(failures["error"].astype(str))


def test_without_slurm_accounting_job_states_come_from_squeue_in_sacct_format(monkeypatch):
    """make test-slurm runs it for real; here the format: submitit reads squeue's lines as sacct's."""
    import subprocess as sp

    from submitit.slurm.slurm import SlurmInfoWatcher

    from hydra_plugins.evictlab_sweeper import evictlab_sweeper as sweeper

    monkeypatch.setattr(SlurmInfoWatcher, "_make_command", SlurmInfoWatcher._make_command)  # restored after

    def no_accounting(*args, **kwargs):
        raise sp.CalledProcessError(1, "sacct")

    monkeypatch.setattr(sp, "run", no_accounting)
    sweeper.watch_with_squeue_without_accounting()
    watcher = SlurmInfoWatcher()
    watcher.register_job("14_0")
    watcher.register_job("15_2")
    command = watcher._make_command()
    assert command[:2] == ["sh", "-c"] and "squeue -h -t all" in command[2] and command[-1] == "14,15"
    states = watcher.read_info("JobID|State|NodeList\n14_0|CANCELLED|vm\n15_[1-3]|PENDING|\n")
    assert states["14_0"]["State"] == "CANCELLED" and states["15_2"]["State"] == "PENDING"


def test_runs_record_their_text_and_aggregation_refuses_a_changed_corpus(outputs: Path, capsys):
    """Every run records the sha256 of the token streams it measured; runs of the same stream settings that
    measured different text (a corpus that changed between them: a package that installs manual pages) are
    refused in one line that names them, while other stream settings are free to differ."""
    import torch

    from evictlab.analysis.aggregate import main as aggregate_main
    from evictlab.store import read_json, tokens_sha256, write_json

    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert tokens_sha256(t) == tokens_sha256(t.clone().to(torch.int32))  # the values, not the dtype
    assert tokens_sha256(t) != tokens_sha256(t.view(3, 2)) != tokens_sha256(t.flip(1))  # shape and order
    runs = {}
    for strategy, length in (("window", 96), ("streaming_llm", 96), ("window", 80)):
        cfg = cfg_for(
            outputs, f"strategy={strategy}", "budget=b16", "logger=none", f"eval.stream_len={length}"
        )
        runs[strategy, length] = (run_mod.run(cfg), run_mod.run_dir(cfg))
    shas = {k: m["streams_sha256"] for k, (m, _) in runs.items()}
    assert shas["window", 96] == shas["streaming_llm", 96] != shas["window", 80]  # policies share the text
    group = runs["window", 96][1].parent
    assert aggregate_main([str(group)]) == 0  # two stream lengths: two settings, each with one text
    capsys.readouterr()
    changed = runs["streaming_llm", 96][1] / "metrics.json"
    write_json(changed, read_json(changed) | {"streams_sha256": "f" * 64})  # as if run on another corpus
    assert aggregate_main([str(group)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measured 2 different texts" in err
    assert runs["streaming_llm", 96][1].name in err and "man_pages" in err
