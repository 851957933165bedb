from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class Window(Policy):
    """Sliding window: keep the `budget` most recent entries, evict the oldest."""

    name: ClassVar[str] = "window"
    order: ClassVar[int] = 1
    position_only: ClassVar[bool] = True

    def static_window(self, budget: int) -> tuple[int, int]:
        return 0, budget

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return ctx.pos.to(ctx.keys.dtype)
