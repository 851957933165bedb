"""`python -m evictlab.train` as a user runs it: bad input fails in one clear line, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = ["model=gpt_tiny", "train=tiny", "train.progress=false"]


def _small_corpus(tmp: Path) -> str:
    d = tmp / "small"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"a very short document {i}")
    return str(d)


def _empty_file(tmp: Path) -> str:
    (tmp / "empty.txt").write_text("")
    return str(tmp / "empty.txt")


BAD = [
    # (id, overrides (callables get tmp_path), text the first line must contain)
    ("unknown-model", ["model=gpt_huge"], "model/gpt_huge"),
    ("unknown-dataset", ["dataset=wikipedia_dump"], "dataset/wikipedia_dump"),
    ("embd-not-divisible", ["model.n_embd=100", "model.n_head=3"], "model.n_embd=100"),
    ("missing-path", ["dataset=text_files", "dataset.path=/nonexistent/corpus.txt"], "dataset.path"),
    ("path-not-given", ["dataset=text_files"], "dataset.path"),
    ("empty-path", ["dataset=text_files", lambda t: f"dataset.path={_empty_file(t)}"], "empty"),
    (
        "corpus-too-small",
        ["dataset=text_files", lambda t: f"dataset.path={_small_corpus(t)}"],
        "fewer than one sequence",
    ),
    (
        "seq-beyond-learned-table",
        ["model.pos_emb=learned", "model.block_size=32", "train.seq_len=64"],
        "train.seq_len=64",
    ),
    ("zero-steps", ["train.steps=0"], "train.steps=0"),
    ("negative-steps", ["train.steps=-5"], "train.steps=-5"),
    ("zero-lr", ["train.lr=0"], "train.lr=0"),
    ("negative-lr", ["train.lr=-0.1"], "train.lr=-0.1"),
    ("zero-batch", ["train.batch_size=0"], "train.batch_size=0"),
    ("negative-batch", ["train.batch_size=-4"], "train.batch_size=-4"),
    ("non-integer-seed", ["train.seed=1.5"], "train.seed"),
    ("unknown-key", ["train.stpes=10"], "stpes"),
    ("bad-enum", ["model.pos_emb=alibi"], "pos_emb"),
    # a number where Hydra expects a budget file: rewritten (budget=100 is budget.tokens=100), or one line
    ("budget-list-mixes-files-and-numbers", ["budget=64,b32"], "budget.tokens=64,100"),
    ("budget-number-out-of-range", ["budget=1.5"], "budget=1.5"),
    ("budget-number-negative", ["budget=-4"], "budget.tokens=-4"),
]


@pytest.mark.parametrize("overrides, expect", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_fails_in_one_line_and_writes_nothing(overrides, expect, tmp_path: Path):
    outputs = tmp_path / "outputs"
    args = [o(tmp_path) if callable(o) else o for o in overrides]
    res = run_cli("evictlab.train", *TINY, *args, outputs=outputs)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines, res.stdout
    assert expect in lines[0], res.stderr
    if lines[0].startswith("error: "):  # evictlab's own checks: exactly one line, no traceback
        assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert not (outputs / "checkpoints").exists() or not any((outputs / "checkpoints").iterdir())
    assert not any((outputs / "cache").rglob("*.npz")) if (outputs / "cache").exists() else True


def test_help_describes_evictlabs_own_groups_and_keys(tmp_path: Path):
    res = run_cli("evictlab.run", "--help", outputs=tmp_path / "outputs")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("evictlab: ") and "budget=100" in out
    groups = out.split("== Config groups (GROUP=OPTION) ==")[1].split("==")[0]
    names = {line.split(":")[0] for line in groups.strip().splitlines()}
    assert {"model", "dataset", "strategy", "budget", "experiment", "variant"} <= names
    assert not [n for n in names if n.startswith("hydra")]  # Hydra's own groups stay in --hydra-help
    assert "policy" not in names and "local" not in names  # the strategy files' schemas, cluster templates
    assert "arm: bos_key, bos_value, none" in groups and "strategy: bos_ablation, full, h2o" in groups
    assert "strategy:" in out.split("== Keys and their defaults")[1]
    assert not (tmp_path / "outputs").exists()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 32 MiB tmpfs (root only, as on CI): the outputs folder of a machine whose disk can fill."""
    import os
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)]).returncode
    ):
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_in_one_line_with_nothing_written_and_the_rerun_completes(small_disk: Path):
    import shutil

    outputs = small_disk / "outputs"
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # fill the device to the last block
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    assert shutil.disk_usage(small_disk).free < 1 << 20
    res = run_cli("evictlab.train", *TINY, "train.steps=3", "train.warmup_steps=1", outputs=outputs)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no space left on the device holding"), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not outputs.exists() or not list(outputs.rglob("*.safetensors"))
    filler.unlink()  # space back: the same command runs
    res = run_cli("evictlab.train", *TINY, "train.steps=3", "train.warmup_steps=1", outputs=outputs)
    assert res.returncode == 0, res.stderr
    assert list(outputs.rglob("model.safetensors"))


@pytest.mark.slow  # (75 s: two real sweeps, one stopped; make test-all runs it)
def test_stopping_a_local_sweep_ends_its_workers_and_the_same_command_finishes_it(tmp_path: Path):
    """SIGTERM to the driver (`kill`), then SIGINT to its process group (Ctrl-C in the terminal): each time
    the joblib workers end with it and no unfinished run counts as done; the same command then completes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from evictlab.store import REPO_ROOT

    outputs = tmp_path / "outputs"
    assert run_cli("evictlab.train", "+experiment=smoke", "logger=none", outputs=outputs).returncode == 0
    sweep = "-m +experiment=smoke hydra/launcher=local logger=none strategy=h2o budget=b16,b32 group=stop"
    cmd = [
        sys.executable,
        "-m",
        "evictlab.run",
        *sweep.split(),
        *"eval.n_streams=24 eval.batch_size=1".split(),
    ]
    cmd.append("eval.force_loop=true")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")} | {
        "EVICTLAB_OUTPUTS": str(outputs)
    }

    def statuses() -> list[str]:
        return sorted(
            json.loads(m.read_text())["status"] for m in (outputs / "runs" / "stop").glob("*/metrics.json")
        )

    for how in ("SIGTERM", "SIGINT"):
        driver = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        workers: list[psutil.Process] = []
        deadline = time.time() + 120
        while time.time() < deadline and len(workers) < 2:  # both workers streaming
            time.sleep(0.5)
            workers = [
                p for p in psutil.Process(driver.pid).children() if "popen_loky" in " ".join(p.cmdline())
            ]
        assert len(workers) == 2, "the sweep's workers never started"
        time.sleep(2)
        if how == "SIGTERM":
            driver.send_signal(signal.SIGTERM)
        else:
            os.killpg(driver.pid, signal.SIGINT)
        _, err = driver.communicate(timeout=60)
        assert driver.returncode == 128 + getattr(signal, how)
        assert f"stopped by {how}" in err.strip().splitlines()[-1]
        assert not psutil.wait_procs(workers, timeout=10)[1]  # none alive
        assert "ok" not in statuses()  # stopped mid-run: nothing counts as done
    again = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert statuses() == ["ok", "ok"]
