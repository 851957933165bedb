from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class Oracle(Policy):
    """Evict the entry that the full-cache run's *future* queries attend to least (summed over all
    later steps and the KV head's query heads). Non-causal: an upper bound for score-based policies,
    labelled as such in every output."""

    name: ClassVar[str] = "oracle"
    label: ClassVar[str] = "oracle (non-causal)"
    order: ClassVar[int] = 9
    needs_future: ClassVar[bool] = True

    def scores(self, ctx: StepContext) -> torch.Tensor:
        assert ctx.future is not None, "the oracle needs the full-cache run's attention"
        return ctx.future(ctx.pos)
