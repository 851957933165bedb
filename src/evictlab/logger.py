"""The `logger` config group's schema (conf/logger/): where and whether runs are mirrored to Weights &
Biases. A leaf, so the run config (config.py) and the one module that talks to W&B (tracking.py) both
import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class LoggerMode(str, Enum):
    offline = "offline"  # write W&B runs locally; `make sync` uploads them later
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    mode: LoggerMode = LoggerMode.offline
    project: str | None = None  # None: $WANDB_PROJECT or "evictlab"
    entity: str | None = None  # None: $WANDB_ENTITY or your default entity
    log_checkpoint: bool = True  # the checkpoint as a W&B artifact (train runs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoggerConfig:
        """From the `logger` node of a run's config.yaml."""
        return cls(**{**d, "mode": LoggerMode(d.get("mode", "offline"))})
