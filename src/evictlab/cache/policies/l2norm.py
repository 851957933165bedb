from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError


@register
@dataclass
class L2Norm(Policy):
    """Keep the keys with the lowest L2 norm (Devoto et al., 2024: low-norm keys draw high attention).
    Scored by each key's norm when it is written (`entry_state`), never by attention. Optional sink and
    recent protection."""

    name: ClassVar[str] = "l2norm"
    order: ClassVar[int] = 7
    n_sink: int = 0
    n_recent: int = 0

    def check_params(self) -> None:
        for key in ("n_sink", "n_recent"):
            if getattr(self, key) < 0:
                raise ConfigError(f"strategy.params.{key}={getattr(self, key)} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + self.n_recent + 1

    def init_state(self, B: int, Hkv: int, S: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"norm": like.new_zeros(B, Hkv, S)}

    def entry_state(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        # The pre-RoPE norm: equal in both position modes, and equal keys (one token id in layer 0)
        # tie exactly instead of by the rounding noise of their rotations.
        return {"norm": k.norm(dim=-1)}

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return protect(-ctx.state["norm"], ctx, n_sink=self.n_sink, n_recent=self.n_recent)
