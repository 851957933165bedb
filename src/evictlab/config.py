"""Config schemas (dataclasses in Hydra's ConfigStore) and helpers to compose and validate them.

`conf/config.yaml` starts its defaults list with `config_schema`, so every YAML group file is
merged into these typed nodes: an unknown key, a wrong type or an unknown enum name fails while
composing. Value checks live in each dataclass's `__post_init__` and run in `to_objects`, before
any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evictlab.data.corpora import DatasetConfig
from evictlab.data.tokenizers import TokenizerConfig
from evictlab.errors import ConfigError
from evictlab.models.gpt import GPTConfig
from evictlab.store import REPO_ROOT

CONF_DIR = REPO_ROOT / "conf"


@dataclass
class TrainConfig:
    steps: int = 1100
    batch_size: int = 32
    seq_len: int = 256  # tokens per training sample, the <bos> (and <sink>) prefix included
    lr: float = 3e-3
    min_lr: float = 3e-4  # cosine decay floor
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 100  # steps between validation losses (and one at the end)
    eval_batches: int = 8
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    device: str = "cpu"
    progress: bool = True  # tqdm bar

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "eval_interval", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.seq_len < 2:
            raise ConfigError(f"train.seq_len={self.seq_len} must be >= 2")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps]")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("train.weight_decay and train.grad_clip must be >= 0")
        if self.threads < 0:
            raise ConfigError(f"train.threads={self.threads} must be >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"train.seed={self.seed!r} must be an integer")


@dataclass
class PathsConfig:
    outputs: str = "${oc.env:EVICTLAB_OUTPUTS,outputs}"


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)

    def __post_init__(self) -> None:
        if self.model.pos_emb == "learned" and self.train.seq_len > self.model.block_size:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} is longer than the learned position table "
                f"(model.block_size={self.model.block_size})"
            )

    @property
    def outputs(self) -> Path:
        return Path(self.paths.outputs)


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)


register_configs()


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose conf/ with overrides, as the command line would (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def to_objects(cfg: DictConfig) -> Config:
    """Resolve and instantiate the schema dataclasses, running every `__post_init__` check."""
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:  # OmegaConf wraps errors raised inside dataclass constructors
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        key = getattr(e, "full_key", None)
        msg = getattr(e, "msg", None) or str(e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key and key not in msg else msg) from None
    assert isinstance(obj, Config)
    return obj
