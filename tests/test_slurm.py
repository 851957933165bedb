"""The cluster path on a real SLURM (`make test-slurm` starts a one-node cluster with scripts/slurm-local.sh
and runs this file; `make test` deselects it): a sweep through hydra-submitit-launcher's SLURM launcher,
one job cancelled with scancel while it runs, a rerun that completes it, and a finished sweep that
submits nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evictlab.store import REPO_ROOT

pytestmark = pytest.mark.slurm

GRID = ["strategy=window,h2o", "budget=b16,b32"]
# two jobs at once on a 2-core node; a short time limit so a stuck job cannot hold CI
SLURM = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
         "hydra.launcher.timeout_min=10"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    if not shutil.which("sinfo") or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        pytest.fail("no SLURM cluster answers (run `make test-slurm`, which starts one)")
    return os.environ.get("SLURM_CONF")


def squeue(*args: str) -> list[str]:
    res = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True)
    return res.stdout.split()


def sweep(outputs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EVICTLAB_OUTPUTS": str(outputs)}
    cmd = [sys.executable, "-m", "evictlab.run", "-m", "+experiment=smoke", "logger=none", *SLURM, *GRID]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def statuses(outputs: Path) -> dict[str, str]:
    return {
        p.parent.name: json.loads(p.read_text())["status"]
        for p in (outputs / "runs" / "smoke").glob("*/metrics.json")
    }


def test_a_sweep_on_slurm_survives_scancel_and_a_rerun_completes_it(cluster, tmp_path: Path):
    outputs = tmp_path / "outputs"
    env = {**os.environ, "EVICTLAB_OUTPUTS": str(outputs)}
    train = [sys.executable, "-m", "evictlab.train", "+experiment=smoke", "logger=none"]
    subprocess.run(train, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    before = set(squeue("-t", "all", "-o", "%i"))
    cancelled: list[str] = []

    def cancel_one_running_job() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not cancelled:
            running = [j for j in squeue("-t", "R", "-o", "%i") if j not in before]
            if running:
                time.sleep(1)  # inside the run
                subprocess.run(["scancel", running[0]], check=True)
                cancelled.append(running[0])
            time.sleep(0.2)

    killer = threading.Thread(target=cancel_one_running_job)
    killer.start()
    first = sweep(outputs)
    killer.join()
    log = first.stdout + first.stderr
    assert cancelled, log
    assert "Bypassing sacct error" not in log  # accounting is off here: states come from squeue
    # Either the cancelled job was launched again within the sweep, or the sweep names it and fails.
    if first.returncode != 0:
        summary = [ln for ln in first.stderr.splitlines() if ln.startswith("error: ")]
        assert len(summary) == 1 and "runs failed" in summary[0] and "its process died" in summary[0], log
        assert "failed" in statuses(outputs).values()
    second = sweep(outputs)
    assert second.returncode == 0, second.stderr
    assert list(statuses(outputs).values()) == ["ok"] * 4
    third = sweep(outputs)  # a finished sweep submits nothing
    assert third.returncode == 0 and "4 of 4 runs already finished: not launched" in third.stderr
    assert "Submitit 'slurm' sweep output dir" not in third.stderr + third.stdout
    # every job ran on the cluster: each run's run_info.json names its SLURM job
    for info in (outputs / "runs" / "smoke").glob("*/run_info.json"):
        assert json.loads(info.read_text())["slurm_job_id"]
