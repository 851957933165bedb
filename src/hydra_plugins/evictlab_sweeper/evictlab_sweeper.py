"""A Hydra sweeper that never launches a finished run.

It expands the sweep grid like Hydra's basic sweeper, then composes each job's config, computes its run
key and drops the jobs whose run folder already holds a finished run of the current format. Only what is
missing reaches the launcher (joblib locally, submitit on SLURM): a rerun of a finished sweep submits
nothing, a partly finished one submits the rest. conf/config.yaml selects it (`hydra/sweeper: evictlab`).

One run's failure is that run's alone: a run that raises is recorded (its metrics.json says failed) and the
others go on; a job whose process dies (a worker killed by the out-of-memory killer, a cancelled SLURM job)
breaks only the launch it was in, whose unfinished jobs are launched again in halves until the one that
dies is alone: it is recorded as failed. The sweep ends with one line naming what failed, and exit 1.
"""

# No `from __future__ import annotations` here: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses cannot resolve string annotations then.
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class EvictlabSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.evictlab_sweeper.evictlab_sweeper.EvictlabSweeper"


class EvictlabSweeper(BasicSweeper):
    def job_config(self, job: list[str]):
        """The validated evictlab Config of one job (raises ConfigError)."""
        from evictlab.config import to_objects

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        with open_dict(cfg):
            del cfg["hydra"]
        return to_objects(cfg)

    def folder(self, job: list[str]) -> Path | None:
        """The job's run folder, or None for a job that does not validate (it is launched and fails there,
        in one line)."""
        from evictlab.errors import ConfigError
        from evictlab.identity import run_dir

        try:
            return run_dir(self.job_config(job))
        except ConfigError:
            return None

    def finished(self, job: list[str]) -> bool:
        """Does this job's run folder already hold a finished run?"""
        from evictlab.identity import is_done

        folder = self.folder(job)
        return folder is not None and is_done(folder)

    def sweep(self, arguments: list[str]) -> Any:
        """Hydra's basic sweep, with failures collected instead of raised at the first one."""
        params = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params), self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        if type(self.launcher).__name__ == "SlurmLauncher":
            watch_with_squeue_without_accounting()
        returns, failed, total, idx = [], [], 0, 0
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            results, dead = self.launch_surviving(batch, idx)
            failed += [
                (r.overrides, _first_line(r._return_value)) for r in results if r.status == JobStatus.FAILED
            ]
            failed += dead
            idx, total = idx + len(batch), total + len(batch)
            returns.append(results)
        if failed:
            what = "; ".join(f"[{' '.join(o)}] {why}" for o, why in failed)
            print(f"error: {len(failed)} of {total} runs failed: {what}", file=sys.stderr)
            sys.exit(1)
        return returns

    def launch_surviving(self, batch, idx: int) -> tuple[list[JobReturn], list[tuple[list[str], str]]]:
        """Launch a batch; if a job's process dies, launch the unfinished jobs again in halves until the one
        that dies is alone. Returns (job returns, [(overrides, why)] of the jobs whose process died)."""
        try:
            return list(self.launcher.launch(batch, initial_job_idx=idx)), []
        except Exception as e:  # noqa: BLE001 - joblib TerminatedWorkerError, submitit UncompletedJobError, ...
            why = f"its process died ({_first_line(e)})"
        todo = [job for job in batch if not self.finished(job)]
        if len(todo) <= 1:
            for job in todo:
                self.record_death(job, why)
            return [], [(list(job), why) for job in todo]
        print(
            f"a job's process died; launching the {len(todo)} unfinished runs again, in halves",
            file=sys.stderr,
        )
        time.sleep(1)  # let a killed worker pool shut down
        half = len(todo) // 2
        first, dead_a = self.launch_surviving(todo[:half], idx)
        second, dead_b = self.launch_surviving(todo[half:], idx + half)
        return first + second, dead_a + dead_b

    def record_death(self, job, why: str) -> None:
        """Write a failed metrics.json for a run whose process died (it could not write one itself)."""
        from evictlab import results as R
        from evictlab.errors import ConfigError
        from evictlab.identity import run_dir, run_key
        from evictlab.store import write_json

        try:
            cfg = self.job_config(job)
        except ConfigError:
            return
        key = run_key(cfg)
        out = run_dir(cfg, key)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / R.METRICS, {"status": "failed", "run_key": key, "error": f"KilledError: {why}"})

    def split_arguments(self, overrides: Any, max_batch_size: int | None) -> list[list[list[str]]]:
        """The grid's jobs, one per run: jobs that map to one run folder (the full cache at every budget,
        jobs that differ only in keys no result depends on) launch once, and finished runs not at all."""
        from evictlab.identity import is_done

        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        jobs = [job for batch in batches for job in batch]
        folders = [self.folder(job) for job in jobs]
        runs = len({f for f in folders if f is not None}) + folders.count(None)  # an invalid job: its own
        seen, todo = set(), []
        for job, folder in zip(jobs, folders, strict=True):
            if folder is None:
                todo.append(job)
            elif folder not in seen:
                seen.add(folder)
                if not is_done(folder):
                    todo.append(job)
        done = runs - len(todo)
        shared = f" ({len(jobs)} jobs: some share a run, as the full cache's one run serves every budget)"
        if done:
            print(
                f"{done} of {runs} runs already finished: not launched"
                + (shared if runs < len(jobs) else ""),
                file=sys.stderr,
            )
        size = max_batch_size or len(todo) or 1
        return [todo[i : i + size] for i in range(0, len(todo), size)]


def watch_with_squeue_without_accounting() -> None:
    """On a SLURM without job accounting (`AccountingStorageType=accounting_storage/none`, as on a small
    test cluster) `sacct` fails: submitit then warns on every poll ("Bypassing sacct error") and never sees
    a cancelled or killed job end, so the sweep waits forever. There, read job states from `squeue -t all`
    (which lists ended jobs for MinJobAge seconds) in sacct's format. With accounting, nothing changes."""
    import subprocess

    from submitit.slurm.slurm import SlurmInfoWatcher

    try:
        subprocess.run(["sacct", "-n", "-j", "1"], check=True, capture_output=True, timeout=30)
        return
    except (OSError, subprocess.SubprocessError):
        pass

    def squeue_command(watcher: SlurmInfoWatcher) -> list[str] | None:
        jobs = sorted({x.split("_")[0] for x in watcher._registered - watcher._finished})
        if not jobs:
            return None
        script = 'echo "JobID|State|NodeList"; exec squeue -h -t all -o "%i|%T|%N" -j "$1"'
        return ["sh", "-c", script, "squeue", ",".join(jobs)]

    SlurmInfoWatcher._make_command = squeue_command
    log.info("SLURM job accounting is off (sacct fails): job states are read from squeue")


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The error on one line: its type and its message with newlines squashed, cut at `limit` characters."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


ConfigStore.instance().store(
    group="hydra/sweeper", name="evictlab", node=EvictlabSweeperConf, provider="evictlab"
)
