from dataclasses import dataclass
from typing import ClassVar

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class RecomputeWindow(Policy):
    """Sliding window with re-computation (the StreamingLLM paper's baseline): each token is predicted
    by a fresh forward over the last `budget` tokens plus itself, re-encoded at positions 0 .. budget in
    both position modes (with RoPE the text positions would give the same scores up to rounding; with
    learned absolute positions they would run past the table). No KV cache survives between steps; the
    cost is O(budget) forward tokens per predicted token."""

    name: ClassVar[str] = "recompute_window"
    label: ClassVar[str] = "window+recompute"
    order: ClassVar[int] = 3
    recompute: ClassVar[bool] = True

    def static_window(self, budget: int) -> tuple[int, int]:
        """The tokens each re-encoded window holds (for the attention-lost diagnostic)."""
        return 0, budget

    def scores(self, ctx: StepContext):
        raise RuntimeError("recompute_window has no cache to evict from")
