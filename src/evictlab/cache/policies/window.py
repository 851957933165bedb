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
    position_only: ClassVar[bool] = True

    def static_keep(self, n: int, budget: int, device: torch.device) -> torch.Tensor:
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        return (j <= i) & (j >= i - budget)

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return ctx.pos.to(ctx.keys.dtype)
