"""Config schemas (dataclasses in Hydra's ConfigStore) and helpers to compose and validate them.

`conf/config.yaml` starts its defaults list with `config_schema`, so every YAML group file is
merged into these typed nodes: an unknown key, a wrong type or an unknown enum name fails while
composing. Value checks live in each dataclass's `__post_init__` and run in `to_objects`, before
any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evictlab.cache.budget import Allocation, budgets_for
from evictlab.cache.policies import POLICIES, Policy, full_cache, make_policy
from evictlab.data.corpora import DatasetConfig
from evictlab.data.streams import StreamSource
from evictlab.data.tokenizers import TokenizerConfig
from evictlab.errors import ConfigError
from evictlab.eval.spec import PositionMode, StreamSpec, check_positions, check_reference_cap
from evictlab.logger import LoggerConfig
from evictlab.models.gguf import is_gguf
from evictlab.models.gpt import GPTConfig, PosEmb
from evictlab.store import REPO_ROOT, to_jsonable

CONF_DIR = REPO_ROOT / "conf"

# Field metadata that decides what a run key and a checkpoint key hash (`key_dict`), declared once per field:
KEYLESS = {"in_key": False}  # cannot change any number a run or a training produces: in no key
NOT_WEIGHTS = {"weights": False}  # cannot change the trained weights: not in the checkpoint key


def neutral(value: Any) -> dict[str, Any]:
    """A field added after results existed: at this value it is left out of every key, so the keys of
    older models and runs stay valid."""
    return {"neutral": value}


def key_dict(obj: Any, *, weights: bool = False) -> Any:
    """A schema dataclass as the JSON value its key hashes: without KEYLESS fields (and NOT_WEIGHTS ones
    when weights=True) and without fields at their neutral value; a node with a `keyed()` method hashes
    what that returns."""
    if hasattr(obj, "keyed"):
        return to_jsonable(obj.keyed())
    if not dataclasses.is_dataclass(obj):
        return to_jsonable(obj)
    out = {}
    for f in dataclasses.fields(obj):
        value, meta = getattr(obj, f.name), f.metadata
        if meta.get("in_key", True) is False or (weights and meta.get("weights", True) is False):
            continue
        if "neutral" in meta and value == meta["neutral"]:
            continue
        out[f.name] = key_dict(value, weights=weights)
    return out


class SyntheticKind(str, Enum):
    events = "events"  # data/synthetic.py: make_synthetic_sequence
    copy = "copy"  # data/synthetic.py: make_copy_sequence


@dataclass
class TrainConfig:
    steps: int = 800
    batch_size: int = 16
    seq_len: int = 512  # tokens per training sample, the <bos> (and <sink>) prefix included
    lr: float = 3e-3
    min_lr: float = 3e-4  # cosine decay floor
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = field(default=100, metadata=NOT_WEIGHTS)  # steps between validation losses
    eval_batches: int = field(default=8, metadata=NOT_WEIGHTS)
    seed: int = 0
    # torch intra-op threads while training: the CPU kernels reduce in a thread-dependent order, so the
    # count changes the weights' bits and is in the checkpoint key (the caller's setting is restored after)
    threads: int = 2
    device: str = field(default="cpu", metadata=KEYLESS)
    progress: bool = field(default=True, metadata=KEYLESS)  # tqdm bar
    # seconds between saves of a training's progress (a killed training continues from the last one)
    save_every_s: float = field(default=60.0, metadata=KEYLESS)
    recall_share: float = 0.0  # share of training samples replaced by pass-key documents (data/recall.py)
    # times each training pass-key document asks for (and answers) its key
    recall_queries: int = field(default=1, metadata=neutral(1))
    # share of training samples replaced by synthetic in-context documents (data/synthetic.py)
    synthetic_share: float = field(default=0.0, metadata=neutral(0.0))
    # which synthetic documents: events (repeats, trigger bigrams, key-value records in natural text) or
    # copy (random segments each written 2-3 times in a row, little filler: about half the tokens are copies)
    synthetic_kind: SyntheticKind = field(default=SyntheticKind.events, metadata=neutral("events"))
    # a curriculum: the first steps train on synthetic documents only (copy documents without filler),
    # then the mix above
    synthetic_warmup: int = field(default=0, metadata=neutral(0))

    def __post_init__(self) -> None:
        for key in ("recall_share", "synthetic_share"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        self.synthetic_kind = SyntheticKind(self.synthetic_kind)
        if self.recall_queries < 1:
            raise ConfigError(f"train.recall_queries={self.recall_queries} must be >= 1")
        for key in ("steps", "batch_size", "eval_interval", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.seq_len < 2:
            raise ConfigError(f"train.seq_len={self.seq_len} must be >= 2")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if not 0 <= self.synthetic_warmup <= self.steps:
            raise ConfigError(f"train.synthetic_warmup={self.synthetic_warmup} must be in [0, train.steps]")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps]")
        for key in ("weight_decay", "grad_clip", "save_every_s"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        if self.threads < 1:
            raise ConfigError(
                f"train.threads={self.threads} must be >= 1: the thread count changes the trained weights, "
                "so training runs at an explicit one"
            )
        check_seed("train.seed", self.seed)


@dataclass
class StrategyConfig:
    """An eviction policy by registered name, with its dataclass parameters."""

    name: str = full_cache().name
    params: dict[str, Any] = field(default_factory=dict)  # overrides of the policy dataclass's defaults

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"strategy.name={self.name!r} is unknown; known: {', '.join(sorted(POLICIES))}")
        self.build()  # parameter checks

    def build(self) -> Policy:
        return make_policy(self.name, **dict(self.params))

    def keyed(self) -> dict[str, Any]:
        """What a run key hashes: the policy's name and every parameter, defaults included (so a default
        written in a YAML or left to the dataclass gives the same key), but for parameters added after
        runs were keyed, which count only away from their default (`Policy.key_params`)."""
        return {"name": self.name, "params": self.build().key_params()}


@dataclass
class BudgetConfig:
    """KV entries a layer keeps between steps: absolute (`tokens`) or a fraction of the scored stream.
    `name` (the run folder's and the tables' label) follows the value: b<tokens>, frac1_<n> for 1/n, else
    frac<fraction>, so `budget.tokens=100` is labelled b100 whichever budget file it started from."""

    name: str = "b64"
    tokens: int | None = 64
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.fraction is None):
            raise ConfigError("budget: set exactly one of budget.tokens and budget.fraction")
        if self.tokens is not None and (isinstance(self.tokens, bool) or self.tokens < 1):
            raise ConfigError(f"budget.tokens={self.tokens} must be >= 1")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError(f"budget.fraction={self.fraction} must be in (0, 1]")
        self.name = self.label(self.tokens, self.fraction)

    @staticmethod
    def label(tokens: int | None, fraction: float | None) -> str:
        if tokens is not None:
            return f"b{tokens}"
        inverse = 1 / fraction
        return f"frac1_{round(inverse)}" if abs(inverse - round(inverse)) < 1e-9 else f"frac{fraction:g}"

    def resolve(self, stream_len: int) -> int:
        """Absolute entries for a stream of stream_len tokens (stream_len - 1 predictions)."""
        if self.tokens is not None:
            return self.tokens
        return max(1, round(self.fraction * (stream_len - 1)))


class EvalTask(str, Enum):
    lm = "lm"  # streaming language modelling on the split's text
    recall = "recall"  # pass-key streams (data/recall.py): recall accuracy by needle depth
    # long-context tasks (data/tasks/, one file each): answers written under the policy, graded
    niah_multikey = "niah_multikey"
    niah_multivalue = "niah_multivalue"
    niah_multiquery = "niah_multiquery"
    variable_tracking = "variable_tracking"


@dataclass
class EvalConfig:
    n_streams: int = 8
    stream_len: int = 512  # tokens per stream, the <bos> (and <sink>) prefix included
    stream_source: StreamSource = StreamSource.concat
    split: str = "test"
    position_mode: PositionMode = PositionMode.original
    allocation: Allocation = Allocation.uniform
    batch_size: int = field(default=16, metadata=KEYLESS)
    diagnostics: bool = True  # attention lost / sink mass (needs the full-cache attention matrices)
    force_loop: bool = False  # never take the parallel path
    device: str = field(default="cpu", metadata=KEYLESS)
    threads: int = field(default=1, metadata=KEYLESS)  # torch threads per run (sweeps run several at once)
    progress: bool = field(default=False, metadata=KEYLESS)
    # queries per block on the static paths (memory O(block x (block + budget)); numbers equal up to rounding)
    block: int = field(default=2048, metadata=KEYLESS)
    # the full-cache reference (nll_full, KL, agreement, attention diagnostics) covers at most this many
    # predictions per stream; past it those metrics are absent (NaN), and the full cache cannot run
    full_max_len: int = field(default=4096, metadata=neutral(4096))
    # run the token loop (not the blocked path) with its steady-state step through torch.compile: 3-15 s to
    # compile, then ~2.7x the eager loop, though the blocked path was faster still at batch 1
    # (benchmarks/README.md "Long streams"); per-token NLL moves by float rounding only (<= 1e-6), like
    # eval.threads
    compile: bool = field(default=False, metadata=KEYLESS)
    # runs that stream the same tokens through the same checkpoint share one full-cache reference, stored
    # under outputs/cache/references (eval/shared.py); false: every run computes its own (the same numbers)
    share_reference: bool = field(default=True, metadata=KEYLESS)
    generate_tokens: int = 0  # > 0: greedy continuations of this many tokens vs the full cache's
    task: EvalTask = EvalTask.lm
    recall_depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    recall_per_depth: int = 4  # streams per depth (task=recall; eval.n_streams is ignored)
    # also decode each answer greedily under the policy (exact_greedy). For a causal policy it equals the
    # teacher-forced exact match by construction (the same tokens in give the same cache and the same
    # argmax until the first wrong token; tests/test_recall.py checks it), and it re-streams every prompt
    # through the token loop, which on SmolLM2 took twice the evaluation itself: false skips it
    recall_greedy: bool = field(default=True, metadata=neutral(True))
    # window + recompute (strategy=recompute_window) scores only this many predictions per stream, one per
    # equal stratum (eval/spec.py sampled_steps): every prediction costs a forward over the window, hours
    # on a real model; the sampling adds to each stream's variance, so it enters the CIs. 0: every one
    recompute_sample: int = field(default=0, metadata=neutral(0))
    # the prompt format of a task (eval.task=niah_multikey ...): plain for the models trained here, chatml
    # for SmolLM2's chat template (data/tasks/__init__.py)
    task_template: str = field(default="plain", metadata=neutral("plain"))

    def __post_init__(self) -> None:
        if self.n_streams < 1:
            raise ConfigError(f"eval.n_streams={self.n_streams} must be >= 1")
        if self.stream_len < 2:
            raise ConfigError(f"eval.stream_len={self.stream_len} must be >= 2")
        if self.split not in ("train", "val", "test"):
            raise ConfigError(f"eval.split={self.split!r} must be train, val or test")
        if self.threads < 0:
            raise ConfigError(f"eval.threads={self.threads} must be >= 0")
        if not all(0 <= d <= 1 for d in self.recall_depths):
            raise ConfigError(f"eval.recall_depths={list(self.recall_depths)} must lie in [0, 1]")
        if self.recall_per_depth < 1:
            raise ConfigError(f"eval.recall_per_depth={self.recall_per_depth} must be >= 1")
        if not 0 <= self.generate_tokens < self.stream_len:
            raise ConfigError(f"eval.generate_tokens={self.generate_tokens} must be in [0, eval.stream_len)")
        if self.task_template not in ("plain", "chatml"):
            raise ConfigError(f"eval.task_template={self.task_template!r} must be plain or chatml")
        check_device("eval.device", self.device)
        self.spec()

    def spec(self) -> StreamSpec:
        """How each stream is evaluated: the settings the engine reads, as one value."""
        keys = [f.name for f in dataclasses.fields(StreamSpec)]
        return StreamSpec(**{k: getattr(self, k) for k in keys})


@dataclass
class PathsConfig:
    outputs: str = "${oc.env:EVICTLAB_OUTPUTS,outputs}"


def check_seed(key: str, seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{key}={seed!r} must be an integer >= 0")


def check_finite(node: Any, key: str = "") -> None:
    """No NaN or infinite number anywhere in the config (the schemas' range checks catch most, but a
    comparison with NaN is false both ways, so a NaN would slip past `x < 0`)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            check_finite(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            check_finite(v, f"{key}.{k}")
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            check_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{key}={node} must be a finite number")


def check_writable(key: str, path: Path) -> None:
    """`path` is a folder this process can write in, or can be created (its first existing parent is)."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r}: {str(existing)!r} is not writable by this user")


def check_device(key: str, device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{key}={device!r} is not a torch device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={device} but no CUDA GPU is visible to torch on this machine")


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata=KEYLESS)
    paths: PathsConfig = field(default_factory=PathsConfig, metadata=KEYLESS)
    seed: int = 0  # evaluation seed: which stretch of text the streams cover, and seeded policies
    # the sweep (experiment) a run belongs to: names its folder and W&B group
    group: str = field(default="adhoc", metadata=KEYLESS)
    variant: str = "base"  # name of the conf/variant/ recipe the model/train/dataset keys came from
    # name of the conf/arm/ option the strategy and its parameters came from: a label for tables and figures
    # (what it sets is in the key already)
    arm: str = field(default="none", metadata=KEYLESS)
    # in a sweep grid: skip (exit 0) a combination that fails validation
    skip_invalid: bool = field(default=False, metadata=KEYLESS)

    def __post_init__(self) -> None:
        check_finite(self)
        parts = Path(self.group).parts
        if not parts or Path(self.group).is_absolute() or any(p in (".", "..") for p in parts):
            raise ConfigError(
                f"group={self.group!r} must be a relative name (it becomes outputs/runs/<group>/), "
                "not an absolute path or one with '..'"
            )
        if self.model.name_or_path:  # a pretrained checkpoint brings its own tokenizer
            kind = "gguf" if is_gguf(self.model.name_or_path) else "hf"
            self.tokenizer = TokenizerConfig(kind=kind, name_or_path=self.model.name_or_path)
        if self.model.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"model.dtype={self.model.dtype!r} must be float32, float16 or bfloat16")
        if self.model.pos_emb is PosEmb.learned and self.train.seq_len > self.model.block_size:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} is longer than the learned position table "
                f"(model.block_size={self.model.block_size})"
            )
        check_positions(self.model, self.eval.position_mode, self.eval.stream_len)
        check_seed("seed", self.seed)
        check_device("train.device", self.train.device)
        check_writable("paths.outputs", self.outputs)
        n = self.eval.stream_len - 1  # the same checks the engine makes, before any work
        policy = self.strategy.build()
        budgets_for(self.model.n_layer, policy, self.resolved_budget, self.eval.allocation, n)
        check_reference_cap(policy, n, self.eval.spec())

    @property
    def corpus_min_tokens(self) -> int:
        """Tokens the corpus's train and val splits must each hold: one training sequence; none for an
        imported model, which is never trained here (so a pinned, all-held-out corpus serves it)."""
        return 0 if self.model.name_or_path else self.train.seq_len + 1

    @property
    def resolved_budget(self) -> int:
        return self.budget.resolve(self.eval.stream_len)

    @property
    def outputs(self) -> Path:
        return Path(self.paths.outputs)


def register_configs() -> None:
    """The typed schema of conf/config.yaml, and for each registered policy a node `policy/<name>` holding
    its dataclass defaults: `conf/strategy/<name>.yaml` extends it (`defaults: [/policy@_here_: <name>]`),
    so every parameter can be set from the command line while the class stays their only home."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for name, cls in POLICIES.items():
        store.store(group="policy", name=name, node={"name": name, "params": to_jsonable(cls().params())})


def help_groups() -> str:
    """`--help`'s config groups with their options: the folders of conf/ a user chooses from (not hydra/,
    not local/'s cluster templates, and not the `policy` schemas that conf/strategy/ files extend)."""
    folders = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "local"))
    return "\n".join(f"{d.name}: {', '.join(sorted(f.stem for f in d.glob('*.yaml')))}" for d in folders)


register_configs()
OmegaConf.register_new_resolver("evictlab_groups", help_groups, replace=True)  # conf/hydra/help/


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose conf/ with overrides, as the command line would (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=budget_shorthand(list(overrides or [])))


def budget_shorthand(overrides: list[str]) -> list[str]:
    """`budget=100` as `budget.tokens=100` and `budget=0.25` as `budget.fraction=0.25` (also a sweep's
    `budget=64,100`): Hydra reads a config group's value as a file name under conf/budget/, and a number is
    none. A list that mixes numbers with file names is an error that says how to write it."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if key != "budget" or not eq:
            out.append(o)
            continue
        items = value.split(",")
        numeric = [_number(v) for v in items]
        if all(n is None for n in numeric):
            out.append(o)
        elif any(n is None for n in numeric):
            files = ", ".join(sorted(p.stem for p in (CONF_DIR / "budget").glob("*.yaml")))
            raise ConfigError(
                f"budget={value}: a list mixes budget files ({files}) with numbers;"
                " write budget.tokens=64,100 (entries) or budget=b64,b128 (files)"
            )
        elif all(isinstance(n, int) for n in numeric):
            out.append(f"budget.tokens={value}")
        elif all(isinstance(n, float) and 0 < n <= 1 for n in numeric):
            out += [f"budget.fraction={value}", "budget.tokens=null"]
        else:
            raise ConfigError(
                f"budget={value}: a budget is a whole number of entries (budget=100) or a fraction of the "
                "stream in (0, 1] (budget=0.25), not both in one list"
            )
    return out


def _number(text: str) -> int | float | None:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None


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
