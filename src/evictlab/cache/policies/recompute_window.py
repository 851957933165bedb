from dataclasses import dataclass, field
from typing import ClassVar

from evictlab.cache.policies import register
from evictlab.cache.policies.base import ADDED_LATER, Policy, StepContext
from evictlab.errors import ConfigError


@register
@dataclass
class RecomputeWindow(Policy):
    """Sliding window with re-computation (the StreamingLLM paper's baseline): each token is predicted
    by a fresh forward over the last `budget` tokens plus itself, re-encoded at positions 0 .. budget in
    both position modes (with RoPE the text positions would give the same scores up to rounding; with
    learned absolute positions they would run past the table). No KV cache survives between steps; the
    cost is O(budget) forward tokens per predicted token.

    `n_sink` > 0 puts the stream's first `n_sink` tokens at the head of every window (then the last
    `budget - n_sink` tokens and the token itself): with a stream that starts with BOS, `n_sink=1` is
    "window + recompute with BOS prepended", which separates the BOS token's identity from the state
    the first positions carry in a cache."""

    name: ClassVar[str] = "recompute_window"
    label: ClassVar[str] = "window+recompute"
    order: ClassVar[int] = 3
    recompute: ClassVar[bool] = True
    n_sink: int = field(default=0, metadata=ADDED_LATER)  # issue 27: in run keys only when set

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ConfigError(f"strategy.params.n_sink={self.n_sink} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def static_window(self, budget: int) -> tuple[int, int]:
        """The tokens each re-encoded window holds (for the attention-lost diagnostic)."""
        return self.n_sink, budget - self.n_sink

    def scores(self, ctx: StepContext):
        raise RuntimeError("recompute_window has no cache to evict from")
