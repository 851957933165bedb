"""How a stream is evaluated: one settings object from the config to the engine, and the position rules.

`StreamSpec` carries everything about an evaluation besides the model, the tokens, the policy and the
budget. `EvalConfig.spec()` builds it once; `evaluate`, `stream`, `generate`, the naive loop and the
recall and generation metrics all take it as one value, so a new setting is added in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from evictlab.cache.budget import Allocation
from evictlab.errors import ConfigError
from evictlab.models.gpt import GPTConfig, PosEmb

if TYPE_CHECKING:
    from evictlab.cache.policies import Policy


class PositionMode(str, Enum):
    original = "original"  # each key keeps the RoPE phase of its text position
    cache = "cache"  # positions re-indexed inside the cache every step (keys stored before RoPE)


@dataclass(frozen=True)
class StreamSpec:
    position_mode: PositionMode = PositionMode.original
    allocation: Allocation = Allocation.uniform
    batch_size: int = 16  # documents streamed together
    diagnostics: bool = True  # attention lost / sink mass (needs the full-cache attention matrices)
    force_loop: bool = False  # never take the parallel path (the token loop is the cross-check)
    progress: bool = False  # a bar over the run's token-steps (a log line every 5 minutes either way)
    block: int = 2048  # queries per block on the static paths (memory O(block x (block + budget)))
    full_max_len: int = 4096  # the full-cache reference covers at most this many predictions per stream
    compile: bool = False  # the token loop with its steady-state step compiled (instead of the blocked path)
    # the recompute path (window + re-computation, a fresh forward over the window per prediction) scores
    # only this many predictions per stream, one drawn in each of as many equal strata of the stream
    # (`sampled_steps`); 0: every prediction. Other paths score every prediction.
    recompute_sample: int = 0

    def __post_init__(self) -> None:  # accept the enums' string values too
        object.__setattr__(self, "position_mode", PositionMode(self.position_mode))
        object.__setattr__(self, "allocation", Allocation(self.allocation))
        for key in ("batch_size", "block", "full_max_len"):
            if isinstance(getattr(self, key), bool) or getattr(self, key) < 1:
                raise ConfigError(f"eval.{key}={getattr(self, key)} must be >= 1")
        if isinstance(self.recompute_sample, bool) or self.recompute_sample < 0:
            raise ConfigError(
                f"eval.recompute_sample={self.recompute_sample} must be >= 0 (0: every prediction)"
            )


SAMPLE_SEED = 0  # the strata's draws: the same predictions for every stream, run and arm (paired)


def sampled_steps(n: int, k: int) -> list[int]:
    """k of the steps 0 .. n-1, one drawn (seeded: SAMPLE_SEED) in each of k equal strata, ascending; all n
    steps when k is 0 or >= n. The mean over them estimates the mean over every step without bias (each
    stratum holds n / k steps, up to one)."""
    import numpy as np

    if k == 0 or k >= n:
        return list(range(n))
    edges = np.linspace(0, n, k + 1).round().astype(int)
    u = np.random.default_rng(SAMPLE_SEED).random(k)
    return [int(a + x * (b - a)) for a, b, x in zip(edges[:-1], edges[1:], u, strict=True)]


def check_positions(model: GPTConfig, mode: PositionMode | str, stream_len: int | None = None) -> None:
    """The one home of the rules that tie a model's position embedding to how it is streamed: cache mode
    re-indexes RoPE phases (absolute tables cannot be re-indexed), and a learned table bounds the length."""
    if model.pos_emb is PosEmb.rope:
        return
    if PositionMode(mode) is PositionMode.cache:
        raise ConfigError(
            "eval.position_mode=cache needs RoPE: positions cannot be re-indexed inside the cache for a "
            f"model with {model.pos_emb.value} absolute positions"
        )
    if stream_len is not None and stream_len > model.block_size:
        raise ConfigError(
            f"eval.stream_len={stream_len} is longer than the learned position table "
            f"(model.block_size={model.block_size})"
        )


DEFAULT = StreamSpec()  # the default settings (a frozen value, safe as an argument default)


def check_reference_cap(policy: Policy, n: int, spec: StreamSpec) -> None:
    """A policy that is the full cache, or that reads its future, cannot run past the reference's cap."""
    if n <= spec.full_max_len or (policy.evicts and not policy.needs_future):
        return
    why = "keeps every entry" if not policy.evicts else "reads the full-cache run's future"
    raise ConfigError(
        f"strategy={policy.name} {why}: streams of {n + 1} tokens are longer than the full-cache reference "
        f"covers (eval.full_max_len={spec.full_max_len} predictions): shorten eval.stream_len or raise it"
    )
