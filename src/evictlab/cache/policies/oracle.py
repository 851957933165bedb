from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class Oracle(Policy):
    """Evict the entry that the full-cache run's *future* queries attend to least (summed over all
    later steps and the KV head's query heads). Non-causal (it reads the future), but a greedy one-step
    choice, not an upper bound: once entries are gone the policy's own future attention differs from the
    full cache's, and each eviction ignores what later evictions will need. It can lose to a plain
    window: gpt_tiny (train=tiny), budget 16, 8 streams x 512 tokens, seed 0: perplexity 25.81 against
    23.50 for a window and 23.47 for H2O (full cache 23.44; `python -m evictlab.run model=gpt_tiny train=tiny
    strategy=oracle budget=b16`, and the same with strategy=window|h2o)."""

    name: ClassVar[str] = "oracle"
    label: ClassVar[str] = "oracle (non-causal, greedy)"
    order: ClassVar[int] = 9
    needs_future: ClassVar[bool] = True

    def scores(self, ctx: StepContext) -> torch.Tensor:
        assert ctx.future is not None, "the oracle needs the full-cache run's attention"
        return ctx.future(ctx.pos)
