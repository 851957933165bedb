"""Errors that mean "the user asked for something impossible": reported in one line, before any work."""


class ConfigError(ValueError):
    """A bad configuration value or input; the message names the offending key."""


class DataError(ConfigError):
    """A corpus that cannot be loaded or is unusable (missing path, too small, offline hub)."""


class DivergedError(ConfigError):
    """Numbers became NaN or infinite (a training loss, an evaluation's NLL): these settings give no result,
    and nothing is cached or reported as ok."""
