"""The command-line entry points' shared frame (`python -m evictlab.run ...`, `evictlab.train`): compose conf/
with the command line through Hydra, validate it, run the job, and turn a bad value into one `error:` line."""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig

from evictlab.config import CONF_DIR, Config, budget_shorthand, to_objects
from evictlab.errors import ConfigError, TrainingInterrupted


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


def _fail(e: ConfigError) -> None:
    """One `error:` line and exit 2; inside a sweep the job fails instead (the sweep goes on and lists it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    print(f"error: {e}", file=sys.stderr)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise e
    sys.exit(2)
