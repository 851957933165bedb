from dataclasses import dataclass
from typing import ClassVar

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class RecomputeWindow(Policy):
    """Sliding window with re-computation (the StreamingLLM paper's baseline): each token is predicted
    by a fresh forward over the last `budget` tokens plus itself, re-encoded from position 0. No KV
    cache survives between steps; the cost is O(budget) forward tokens per predicted token."""

    name: ClassVar[str] = "recompute_window"
    recompute: ClassVar[bool] = True

    def scores(self, ctx: StepContext):
        raise RuntimeError("recompute_window has no cache to evict from")
