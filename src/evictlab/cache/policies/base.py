"""What an eviction policy is: a small dataclass that scores cache entries; the engine evicts the lowest.

The cache of one layer is a set of slots per (document, KV head). A policy never moves data; it sees a
`StepContext` after each decode step's attention and answers `scores`: one number per slot, the
lowest valid one is evicted (ties go to the oldest position). `inf` protects a slot.

Per-slot state a policy keeps (accumulated attention, counters) lives in `ctx.state`, a dict of
tensors shaped [B, Hkv, S, ...] whose dim 2 is the slot: the engine resets a slot's state when a new
entry is written there (to zero, or to `entry_state`), and the naive loop deletes rows, so
policies never manage slot reuse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from evictlab.errors import ConfigError

INF = float("inf")
SCALARS = {"bool": bool, "int": int, "float": float}
# field metadata of a parameter added after runs were keyed: at its default it is left out of the run key,
# so the runs made before it keep theirs (`Policy.key_params`)
ADDED_LATER = {"keyed_at_default": False}


@dataclass
class StepContext:
    """What a policy may look at after the attention of decode step t (query position t)."""

    # the position (and step index) of the token just decoded, and the layer: ints, or (the compiled loop)
    # a 0-dim tensor t, or (the wavefront, eval/wavefront.py: rows of several layers at their own steps)
    # tensors [B, 1, 1] that broadcast against pos
    t: int | torch.Tensor
    layer: int | torch.Tensor
    budget: int  # entries this layer keeps between steps
    pos: torch.Tensor  # [B, Hkv, S] text position of each slot, -1 where empty
    keys: torch.Tensor  # [B, Hkv, S, D] keys as stored (post-RoPE in `original` mode, pre-RoPE in `cache`)
    attn: torch.Tensor | None  # [B, Hkv, S] this step's attention on each slot, averaged over the query
    #                              heads that share the KV head (None unless policy.needs_attention)
    state: dict[str, torch.Tensor]
    doc: torch.Tensor  # [B] global document index (for reproducible per-document randomness)
    future: Callable[[torch.Tensor], torch.Tensor] | None = None  # oracle only: pos -> future attention

    @property
    def valid(self) -> torch.Tensor:
        return self.pos >= 0


@dataclass
class Policy:
    """Base class. Subclasses are dataclasses whose fields are the policy's parameters."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""  # the name in figures and tables (`register` sets it to `name` if empty)
    order: ClassVar[int] = 100  # position in figures, tables and legends (smaller first)
    needs_attention: ClassVar[bool] = False  # observe() needs the attention row (no fused SDPA)
    needs_future: ClassVar[bool] = False  # uses the full-cache run's future attention (non-causal)
    evicts: ClassVar[bool] = True  # False for `full` and the ablations of the full cache
    ablation: ClassVar[bool] = False  # a full cache with an intervention (bos_ablation): not the reference
    recompute: ClassVar[bool] = False  # True only for `recompute_window` (no KV cache at all)
    # Decisions depend on positions only, so every document and head holds the same positions in the
    # same slots (lets the engine re-index positions once per layer instead of per document and head).
    position_only: ClassVar[bool] = False
    # Decisions read no keys, values, queries or attention (random's are hashes of positions): rounding
    # cannot reorder them, so verify holds them to the plain tolerance and `make noise` does not re-run them.
    reads_values: ClassVar[bool] = True

    @classmethod
    def can_generate(cls) -> bool:
        """Decodes free-running text: not a non-causal policy (it reads the future) nor an ablation (its
        intervention exists on the parallel path only, which streams known text)."""
        return not (cls.needs_future or cls.ablation)

    def __post_init__(self) -> None:
        self.check_types()
        self.check_params()

    def check_types(self) -> None:
        """Each parameter has its field's type: an int field takes an integer (not 2.5, not a bool), a bool
        field true or false (not the string "no"), a float field a finite number."""
        for f in dataclasses.fields(self):
            # the annotation as written: a type, or its name under `from __future__ import annotations`
            value, kind = getattr(self, f.name), SCALARS.get(f.type, f.type)
            is_bool = isinstance(value, bool)
            if kind is bool:
                ok, want = is_bool, "true or false"
            elif kind is int:
                ok, want = isinstance(value, int) and not is_bool, "an integer"
            elif kind is float:
                number = isinstance(value, int | float) and not is_bool
                ok, want = number and math.isfinite(value), "a finite number"
            else:
                continue
            if not ok:
                raise ConfigError(f"strategy.params.{f.name}={value!r} must be {want}")

    def check_params(self) -> None:
        """Validate the policy's own parameters (raise ConfigError)."""

    def min_budget(self) -> int:
        """The smallest budget this policy can work with."""
        return 1

    def validate(self, budget: int) -> None:
        if budget < 1:
            raise ConfigError(f"budget={budget} must be >= 1")
        if budget < self.min_budget():
            raise ConfigError(
                f"budget={budget} is too small for strategy {self.name!r} ({self.describe()}): "
                f"it needs at least {self.min_budget()}"
            )

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({params})"

    def params(self) -> dict:
        return asdict(self)

    def key_params(self) -> dict:
        """The parameters a run key hashes: every one, defaults included, except a parameter added later
        (`ADDED_LATER`) while it is at its default."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("keyed_at_default", True) or getattr(self, f.name) != f.default
        }

    @classmethod
    def facts(cls) -> dict:
        """What the results record about the policy class, so that analysis needs no registry."""
        return {
            "strategy": cls.name,
            "strategy_label": cls.label,
            "strategy_order": cls.order,
            "evicts": cls.evicts,
            "ablation": cls.ablation,
            "non_causal": cls.needs_future,
        }

    # ---- the static path (position-static policies only) ------------------------------------------
    def static_window(self, budget: int) -> tuple[int, int | None] | None:
        """For policies whose kept set depends only on positions: (n_sink, lookback), meaning query i
        attends to keys j <= i with j < n_sink or j >= i - lookback (lookback None: every earlier key).
        None = not position-static (use the token loop)."""
        return None

    # ---- the token loop ------------------------------------------------------------------------------
    def init_state(self, B: int, Hkv: int, S: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-slot state tensors [B, Hkv, S, ...] (device and float dtype taken from `like`)."""
        return {}

    def entry_state(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        """Initial per-slot state of a new entry from its pre-RoPE key k [B, Hkv, 1, D]; each value is
        [B, Hkv, 1, ...]. State tensors not returned here start at zero."""
        return {}

    def observe(self, ctx: StepContext) -> None:
        """Update per-slot state after the step's attention (before eviction)."""

    def scores(self, ctx: StepContext) -> torch.Tensor:
        """[B, Hkv, S]: the valid slot with the lowest score is evicted; inf protects a slot."""
        raise NotImplementedError


def protect(scores: torch.Tensor, ctx: StepContext, n_sink: int = 0, n_recent: int = 0) -> torch.Tensor:
    """Give inf to the first n_sink positions and to the n_recent newest positions (t-n_recent+1 .. t)."""
    keep = ctx.pos > ctx.t - n_recent
    if n_sink:
        keep |= ctx.pos < n_sink
    if n_sink or not isinstance(ctx.t, int) or ctx.t - n_recent < -1:  # an empty slot (-1) could match
        keep &= ctx.valid
    return scores.masked_fill(keep, INF)


def choose_victim(scores: torch.Tensor, pos: torch.Tensor, all_valid: bool = False) -> torch.Tensor:
    """Slot index [B, Hkv] to evict: the lowest score among valid slots, ties to the oldest position.
    `all_valid`: the caller knows every slot holds an entry (the same answer in fewer operations)."""
    big = torch.iinfo(pos.dtype).max
    if all_valid:  # when every slot is protected, all equal the lowest (inf): the fallback to all
        low = scores.amin(dim=-1, keepdim=True)
        return torch.where(scores == low, pos, big).argmin(dim=-1)
    valid = pos >= 0
    s = scores.masked_fill(~valid, INF)
    low = s.amin(dim=-1, keepdim=True)
    cand = valid & ((s == low) | (low == INF))  # if every valid slot is protected, fall back to all
    return pos.masked_fill(~cand, big).argmin(dim=-1)
