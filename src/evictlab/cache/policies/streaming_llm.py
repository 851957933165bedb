from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError


@register
@dataclass
class StreamingLLM(Policy):
    """Attention sinks + sliding window (Xiao et al., 2023): keep the first `n_sink` positions forever
    and the most recent `budget - n_sink` entries."""

    name: ClassVar[str] = "streaming_llm"
    label: ClassVar[str] = "StreamingLLM"
    order: ClassVar[int] = 2
    position_only: ClassVar[bool] = True
    n_sink: int = 4

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ConfigError(f"strategy.params.n_sink={self.n_sink} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def validate(self, budget: int) -> None:
        if budget >= 1 and budget <= self.n_sink:
            raise ConfigError(
                f"budget={budget} must be larger than strategy.params.n_sink={self.n_sink} "
                "(the sinks count toward the budget and the window needs at least one entry)"
            )
        super().validate(budget)

    def static_window(self, budget: int) -> tuple[int, int]:
        return self.n_sink, budget - self.n_sink

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return protect(ctx.pos.to(ctx.keys.dtype), ctx, n_sink=self.n_sink)
