"""Errors that mean "the user asked for something impossible": reported in one line, before any work."""


class ConfigError(ValueError):
    """A bad configuration value or input; the message names the offending key."""


class DataError(ConfigError):
    """A corpus that cannot be loaded or is unusable (missing path, too small, offline hub)."""


class DivergedError(ConfigError):
    """Numbers became NaN or infinite (a training loss, an evaluation's NLL): these settings give no result,
    and nothing is cached or reported as ok."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a training at the end of a step, after saving its progress (train.py's Progress): the
    command-line entry points print its one line and exit 130; the same command continues the training."""


class DiskFullError(ConfigError):
    """No space left while writing a result, cache or checkpoint file: nothing half-written was kept (files
    are written to a temp name and renamed), so the run can simply be repeated once space is freed."""


def is_disk_full(e: BaseException) -> bool:
    """An OSError with ENOSPC, or a library's wrapping of one (safetensors reports the OS error in text)."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "StorageFull" in text or "os error 28" in text
