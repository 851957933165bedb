"""The command-line entry points' shared frame (`python -m evictlab.run ...`, `evictlab.train`): compose conf/
with the command line through Hydra, validate it, run the job, and turn a bad value into one `error:` line."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from evictlab.config import CONF_DIR, Config, budget_shorthand, to_objects
from evictlab.errors import ConfigError, TrainingInterrupted
from evictlab.store import outputs_dir

# below this much free space where the outputs go, an entry point stops before Hydra writes its run folder
# (Hydra's own config files would fail first, with its traceback); a run's own writes end in one line too
MIN_FREE_BYTES = 1 << 20


def hydra_entry(job: Callable[[Config], str]) -> None:
    """A command-line entry point: compose conf/ with the command line (Hydra), validate it, run `job` and
    print the line it returns. A bad value or input prints `error: ...` and exits 2; in a sweep grid with
    skip_invalid=true, a combination that fails validation is skipped (exit 0)."""
    import hydra

    try:
        sys.argv[1:] = budget_shorthand(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    check_space(outputs_from(sys.argv[1:]))
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        end_workers_on_signals()

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(dcfg: DictConfig) -> None:
        try:
            cfg = to_objects(dcfg)
        except ConfigError as e:
            if dcfg.get("skip_invalid"):  # a grid that crosses e.g. learned positions with cache mode
                print(f"skipped (not a valid combination): {e}", file=sys.stderr)
                return
            _fail(e)
        try:
            line = job(cfg)
        except ConfigError as e:  # data-dependent checks (e.g. streams longer than the documents)
            _fail(e)
        except TrainingInterrupted as e:  # Ctrl-C in a training: progress saved; stops a sweep too
            print(f"stopped: {e}", file=sys.stderr)
            sys.exit(130)
        print(line)

    _main()


def outputs_from(argv: list[str]) -> Path:
    """The outputs folder a command line names (paths.outputs=...), else $EVICTLAB_OUTPUTS or ./outputs."""
    named = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("paths.outputs=")]
    return outputs_dir(named[-1] if named else None)


def check_space(out: Path) -> None:
    """One `error:` line and exit 1 when the device that holds `out` has less than MIN_FREE_BYTES free:
    nothing is written, and the same command runs once space is freed."""
    probe = out.resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE_BYTES:
        print(
            f"error: no space left on the device holding {out} ({free / 2**10:.0f} KiB free): nothing was "
            "written; free space and run the same command again",
            file=sys.stderr,
        )
        sys.exit(1)


def end_workers_on_signals() -> None:
    """A sweep's driver: Ctrl-C or SIGTERM ends its worker processes too (the local launcher's joblib/loky
    workers ignore SIGINT and outlive a killed driver, finishing and writing their runs), then the driver,
    in one line. A run that was not finished is not marked done (its files are written atomically at its
    end), so the same command continues the sweep. Inside a run or a training, their own handlers (SIGTERM
    records the run as failed; Ctrl-C saves training progress) take precedence while they run."""
    import os
    import signal

    def stop(signum, _frame) -> None:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=10)
        print(
            f"stopped by {signal.Signals(signum).name}: {len(children)} worker process(es) ended; finished "
            "runs are kept, the same command runs the rest",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _fail(e: ConfigError) -> None:
    """One `error:` line and exit 2; inside a sweep the job fails instead (the sweep goes on and lists it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    print(f"error: {e}", file=sys.stderr)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise e
    sys.exit(2)
