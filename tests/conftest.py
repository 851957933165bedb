"""Shared fixtures: an isolated outputs/ per test and one tiny trained checkpoint per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evictlab.config import Config, compose, to_objects
from evictlab.store import REPO_ROOT

TINY = ["model=gpt_tiny", "train=tiny", "train.progress=false"]


def make_cfg(outputs: Path, *overrides: str) -> Config:
    return to_objects(compose([*TINY, f"paths.outputs={outputs}", *overrides]))


@pytest.fixture(autouse=True)
def close_figures():
    """Every figure a test draws is closed after it (matplotlib warns past 20 open figures)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


@pytest.fixture(scope="session")
def session_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("session") / "outputs"


@pytest.fixture(scope="session")
def tiny_checkpoint(session_outputs: Path):
    from evictlab.checkpoints import get_checkpoint

    return get_checkpoint(make_cfg(session_outputs))


@pytest.fixture(scope="session")
def smollm2_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An outputs/ where SmolLM2-135M's GGUF has been converted into the checkpoint cache (about a minute,
    once per session): the tests that stream it load it from there."""
    from evictlab.checkpoints import get_checkpoint

    out = tmp_path_factory.mktemp("smollm2") / "outputs"
    get_checkpoint(make_cfg(out, "model=smollm2_135m"))
    return out


def run_cli(
    module: str, *args: str, outputs: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run `python -m module args` as a user would; outputs/ isolated via EVICTLAB_OUTPUTS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    if outputs is not None:
        env["EVICTLAB_OUTPUTS"] = str(outputs)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
