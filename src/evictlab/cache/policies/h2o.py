from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError


@register
@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., 2023): per layer and KV head, keep the entries with the largest
    attention accumulated over all past steps, plus a window of recent entries. `recent_fraction` of
    the budget goes to the recent window, the rest to heavy hitters."""

    name: ClassVar[str] = "h2o"
    order: ClassVar[int] = 4
    needs_attention: ClassVar[bool] = True
    recent_fraction: float = 0.5

    def check_params(self) -> None:
        if not 0 < self.recent_fraction < 1:
            raise ConfigError(f"strategy.params.recent_fraction={self.recent_fraction} must be in (0, 1)")

    def n_recent(self, budget: int) -> int:
        return int(round(self.recent_fraction * budget))

    def validate(self, budget: int) -> None:
        super().validate(budget)
        recent = self.n_recent(budget)
        if recent < 1 or budget - recent < 1:
            raise ConfigError(
                f"h2o split does not fit: recent_fraction={self.recent_fraction} of budget={budget} "
                f"gives {recent} recent and {budget - recent} heavy-hitter entries; both need >= 1"
            )

    def init_state(self, B: int, Hkv: int, S: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"acc": like.new_zeros(B, Hkv, S)}

    def observe(self, ctx: StepContext) -> None:
        ctx.state["acc"] += ctx.attn

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return protect(ctx.state["acc"], ctx, n_recent=self.n_recent(ctx.budget))
