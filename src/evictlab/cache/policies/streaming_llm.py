from dataclasses import dataclass, field
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import ADDED_LATER, INF, Policy, StepContext, protect
from evictlab.errors import ConfigError


@register
@dataclass
class StreamingLLM(Policy):
    """Attention sinks + sliding window (Xiao et al., 2023): keep the first `n_sink` positions forever
    and the most recent `budget - n_sink` entries.

    `first_sink` moves the kept run to positions first_sink .. first_sink + n_sink - 1 (the earlier
    ones are evicted like any old entry): with a stream that starts with BOS, `n_sink=1 first_sink=1`
    keeps the first text token instead of BOS (StreamingLLM's Table 1 substitution: is it the token or
    the position?). Such a run takes the blocked path, not the parallel one."""

    name: ClassVar[str] = "streaming_llm"
    label: ClassVar[str] = "StreamingLLM"
    order: ClassVar[int] = 2
    position_only: ClassVar[bool] = True
    n_sink: int = 4
    first_sink: int = field(default=0, metadata=ADDED_LATER)  # issue 27: in run keys only when set

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ConfigError(f"strategy.params.n_sink={self.n_sink} must be >= 0")
        if self.first_sink < 0:
            raise ConfigError(f"strategy.params.first_sink={self.first_sink} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def validate(self, budget: int) -> None:
        if budget >= 1 and budget <= self.n_sink:
            raise ConfigError(
                f"budget={budget} must be larger than strategy.params.n_sink={self.n_sink} "
                "(the sinks count toward the budget and the window needs at least one entry)"
            )
        super().validate(budget)

    def static_window(self, budget: int) -> tuple[int, int] | None:
        if self.first_sink and self.n_sink:  # the kept run is not a prefix: not a static window
            return None
        return self.n_sink, budget - self.n_sink

    def scores(self, ctx: StepContext) -> torch.Tensor:
        oldest_first = ctx.pos.to(ctx.keys.dtype)
        if not (self.first_sink and self.n_sink):
            return protect(oldest_first, ctx, n_sink=self.n_sink)
        sinks = (ctx.pos >= self.first_sink) & (ctx.pos < self.first_sink + self.n_sink)
        return oldest_first.masked_fill(sinks, INF)
