"""A Hydra sweeper that never launches a finished run.

It expands the sweep grid like Hydra's basic sweeper, then composes each job's config, computes its run
key and drops the jobs whose run folder already holds a finished run of the current format. Only what is
missing reaches the launcher (joblib locally, submitit on SLURM): a rerun of a finished sweep submits
nothing, a partly finished one submits the rest. conf/config.yaml selects it (`hydra/sweeper: evictlab`).
"""

# No `from __future__ import annotations` here: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses cannot resolve string annotations then.
import logging
import sys
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from omegaconf import open_dict

log = logging.getLogger(__name__)


@dataclass
class EvictlabSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.evictlab_sweeper.evictlab_sweeper.EvictlabSweeper"


class EvictlabSweeper(BasicSweeper):
    def finished(self, job: list[str]) -> bool:
        """Does this job's run folder already hold a finished run? (A job that does not validate is not
        finished: it is launched and fails there, in one line.)"""
        from evictlab.config import to_objects
        from evictlab.errors import ConfigError
        from evictlab.run import is_done, run_dir

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        with open_dict(cfg):
            del cfg["hydra"]
        try:
            return is_done(run_dir(to_objects(cfg)))
        except ConfigError:
            return False

    def split_arguments(self, overrides: Any, max_batch_size: int | None) -> list[list[list[str]]]:
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        todo = [[job for job in batch if not self.finished(job)] for batch in batches]
        total, left = sum(map(len, batches)), sum(map(len, todo))
        if left < total:
            print(f"{total - left} of {total} runs already finished: not launched", file=sys.stderr)
        return [batch for batch in todo if batch]


ConfigStore.instance().store(
    group="hydra/sweeper", name="evictlab", node=EvictlabSweeperConf, provider="evictlab"
)
