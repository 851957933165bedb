"""A run's identity: its key (a hash of the config's keyed fields), its folder, and whether that folder
already holds it finished. Light on purpose: the sweeper imports it to skip finished runs without
importing the engine, and nothing here imports run.py."""

from __future__ import annotations

import logging
from pathlib import Path

from evictlab import results as R
from evictlab.config import Config, key_dict
from evictlab.store import read_json, stable_hash

log = logging.getLogger(__name__)


def run_key(cfg: Config) -> str:
    d = key_dict(cfg)
    if not cfg.strategy.build().evicts:  # the full cache ignores the budget: one run serves them all
        d.pop("budget")
    return stable_hash({"config": d, "format": R.KEY_VERSION})


def run_dir(cfg: Config, key: str | None = None) -> Path:
    key = key or run_key(cfg)
    budget = "all" if not cfg.strategy.build().evicts else cfg.budget.name
    return cfg.outputs / "runs" / cfg.group / f"{cfg.strategy.name}-{budget}-{key}"


def is_done(path: Path) -> bool:
    """A finished run of the current format whose result files are sound and whose weights are the ones its
    checkpoint holds now (an older format's run, one with a damaged or missing file, or one of weights that
    were since replaced under its checkpoint's name, is redone in place)."""
    try:
        m = read_json(path / R.METRICS)
    except (OSError, ValueError):
        return False
    if m.get("status") != "ok" or m.get("run_format") not in R.DONE_FORMATS:
        return False
    if (why := R.unreadable(path)) is not None:
        log.warning("redoing %s: %s", path, why)
        return False
    checkpoints = path.parents[2] / "checkpoints"  # path = <outputs>/runs/<group>/<run>
    now = checkpoint_weights(checkpoints / str(m.get("checkpoint")))
    if now is not None and now != m.get("weights_sha256"):
        log.warning(
            "redoing %s: its checkpoint %s now holds other weights (sha256 %s..., the run measured %s...)",
            path,
            m.get("checkpoint"),
            now[:12],
            str(m.get("weights_sha256"))[:12],
        )
        return False
    return True


def checkpoint_weights(folder: Path) -> str | None:
    """The weights hash a cached checkpoint folder records, or None when there is none to compare with."""
    try:
        return read_json(folder / "meta.json").get("weights_sha256")
    except (OSError, ValueError, AttributeError):
        return None
