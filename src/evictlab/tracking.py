"""The only module that talks to Weights & Biases. W&B is a mirror: local files are the truth.

Offline by default (runs land in outputs/wandb/, `make sync` uploads them). If W&B cannot start
(online without a network, a bad key) the run goes on locally and says so in one line.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evictlab.logger import LoggerConfig, LoggerMode

if TYPE_CHECKING:  # the analysis stage imports this module without torch or hydra
    from evictlab.config import Config


# What W&B would collect that evictlab records itself (git state and packages in run_info.json / meta.json)
# or does not need (system metrics sampled every few seconds, source code, requirements): off, so a run
# starts and finishes W&B several times faster once its service is up (benchmarks/run_overhead.py).
LEAN = {
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "disable_git": True,
    "disable_code": True,
    "x_save_requirements": False,
}


@contextmanager
def wandb_run(
    logger: LoggerConfig,
    outputs: Path,
    group: str,
    *,
    job_type: str,
    run_id: str,
    name: str,
    tags: list[str],
    config: dict[str, Any],
) -> Iterator[Any | None]:
    """A W&B run (or None when disabled or unavailable), always finished when the block exits."""
    if logger.mode is LoggerMode.disabled:
        yield None
        return
    try:
        import wandb

        run = wandb.init(
            mode=logger.mode.value,
            project=logger.project or os.environ.get("WANDB_PROJECT") or "evictlab",
            entity=logger.entity or os.environ.get("WANDB_ENTITY") or None,
            dir=str(outputs),
            id=run_id,
            name=name,
            group=group,
            job_type=job_type,
            tags=tags,
            config=config,
            resume="allow",
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off", init_timeout=60, **LEAN),
        )
    except Exception as e:  # noqa: BLE001 - any failure to start W&B must not fail the run
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(
            f"W&B could not start ({type(e).__name__}: {first}); the run continues locally", file=sys.stderr
        )
        yield None
        return
    ok = False
    try:
        yield run
        ok = True
    finally:
        run.finish(exit_code=0 if ok else 1)


def _numeric(d: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v)):
            out[k] = v
    return out


def _run_of(cfg: Config, job_type: str, run_id: str, name: str, tags: list[str], config: dict[str, Any]):
    """A W&B run with the run config's own logger settings, outputs folder and group."""
    kw = {"job_type": job_type, "run_id": run_id, "name": name, "tags": tags, "config": config}
    return wandb_run(cfg.logger, cfg.outputs, cfg.group, **kw)


def log_training(cfg: Config, meta: dict[str, Any], checkpoint: Path) -> None:
    """A job_type=train run: the loss curves, the final losses and the checkpoint as an artifact. A converted
    checkpoint (a GGUF file: no training, no history) logs nothing here; its runs name it."""
    if "history" not in meta:
        return
    tags = [f"model:{cfg.model.name}", f"dataset:{cfg.dataset.name}"]
    config = {k: meta[k] for k in ("model", "train", "dataset", "tokenizer")}
    run_id, name = f"train-{meta['key']}", f"train {checkpoint.name}"
    with _run_of(cfg, "train", run_id, name, tags, config) as run:
        if run is None:
            return
        for row in meta["history"]:
            run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        run.summary.update(_numeric({k: v for k, v in meta.items() if k != "history"}))
        if cfg.logger.log_checkpoint:
            import wandb

            art = wandb.Artifact(
                f"checkpoint-{meta['key']}", type="model", metadata={"path": str(checkpoint)}
            )
            art.add_dir(str(checkpoint))
            run.log_artifact(art)


def log_eval(
    cfg: Config, run_key: str, config: dict[str, Any], metrics: dict[str, Any], curve, generations=None
) -> None:
    """A job_type=eval run: the run's summary metrics and its NLL-by-position curve (table + line plot).

    `curve`: a pandas frame with columns position, nll, nll_full (means over streams); `generations`
    (optional): per stream, the greedy continuations under the policy and the full cache, as a table.
    """
    tags = [
        f"strategy:{cfg.strategy.name}",
        f"budget:{cfg.budget.name}",
        f"model:{cfg.model.name}",
        f"dataset:{cfg.dataset.name}",
        f"position_mode:{cfg.eval.position_mode.value}",
    ]
    name = f"{cfg.strategy.name} {cfg.budget.name} s{cfg.seed} {cfg.eval.position_mode.value}"
    with _run_of(cfg, "eval", run_key, name, tags, config) as run:
        if run is None:
            return
        import wandb

        run.summary.update(_numeric(metrics))
        table = wandb.Table(dataframe=curve)
        run.log(
            {
                "nll_by_position": table,
                "nll_curve": wandb.plot.line(table, "position", "nll", title="NLL by position"),
            }
        )
        if generations is not None:
            run.log({"generations": wandb.Table(dataframe=generations)})


def log_report(logger: LoggerConfig, outputs: Path, group: str, images: dict[str, Path], table) -> None:
    """A job_type=report run in the sweep's group: the figures (PNG) and the headline table."""
    run_id, name, tags = f"report-{group}", f"report {group}", [f"sweep:{group}"]
    with wandb_run(
        logger,
        outputs,
        group,
        job_type="report",
        run_id=run_id,
        name=name,
        tags=tags,
        config={"group": group},
    ) as run:
        if run is None:
            return
        import wandb

        run.log({f"figures/{name}": wandb.Image(str(path)) for name, path in images.items()})
        run.log({"headline": wandb.Table(dataframe=table.astype(str))})
