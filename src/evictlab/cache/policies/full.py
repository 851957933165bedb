from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class Full(Policy):
    """Keep every entry: the reference that every other policy is compared with."""

    name: ClassVar[str] = "full"
    order: ClassVar[int] = 0
    position_only: ClassVar[bool] = True
    evicts: ClassVar[bool] = False

    def static_window(self, budget: int) -> tuple[int, None]:
        return 0, None

    def scores(self, ctx: StepContext) -> torch.Tensor:
        raise RuntimeError("the full cache never evicts")
