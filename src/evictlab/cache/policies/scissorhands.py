from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError


@register
@dataclass
class Scissorhands(Policy):
    """Persistence of importance (Liu et al., 2023): over the last `history_window` steps, count how
    often each entry got less attention than `threshold` x uniform (1 / entries held); evict the entry
    that was unimportant most often. The `n_recent` newest entries are always kept."""

    name: ClassVar[str] = "scissorhands"
    order: ClassVar[int] = 6
    needs_attention: ClassVar[bool] = True
    history_window: int = 32
    threshold: float = 1.0
    n_recent: int = 4

    def check_params(self) -> None:
        if self.history_window < 1:
            raise ConfigError(f"strategy.params.history_window={self.history_window} must be >= 1")
        if self.threshold <= 0:
            raise ConfigError(f"strategy.params.threshold={self.threshold} must be > 0")
        if self.n_recent < 0:
            raise ConfigError(f"strategy.params.n_recent={self.n_recent} must be >= 0")

    def min_budget(self) -> int:
        return self.n_recent + 1

    def init_state(self, B: int, Hkv: int, S: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        # low: the ring buffer of the last history_window steps' verdicts; count: its sum per slot, kept
        # up to date as a column is overwritten (summing the window every step cost ~18% of a step)
        return {
            "low": torch.zeros(B, Hkv, S, self.history_window, dtype=torch.bool, device=like.device),
            "count": torch.zeros(B, Hkv, S, dtype=torch.int32, device=like.device),
        }

    def observe(self, ctx: StepContext) -> None:
        valid = ctx.valid
        held = valid.sum(dim=-1, keepdim=True)  # [B, Hkv, 1]
        low = (ctx.attn < self.threshold / held) & valid
        # the step's column of the ring buffer, per row: t is an int, a 0-dim tensor (compiled loop) or
        # [B, 1, 1] (the wavefront: each row at its own step)
        column = torch.as_tensor(ctx.t % self.history_window, device=low.device)
        idx = column.expand(low.shape)[..., None]  # [B, Hkv, S, 1]
        ring, count = ctx.state["low"], ctx.state["count"]
        count -= ring.gather(-1, idx)[..., 0].to(count.dtype)  # the verdict falling out
        count += low.to(count.dtype)
        ring.scatter_(-1, idx, low[..., None])

    def scores(self, ctx: StepContext) -> torch.Tensor:
        return protect(-ctx.state["count"].to(ctx.keys.dtype), ctx, n_recent=self.n_recent)
