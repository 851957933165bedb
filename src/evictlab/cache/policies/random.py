from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext, protect
from evictlab.errors import ConfigError

_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash on int64 tensors or Python ints, the same values (multipliers < 2**31, so
    products never overflow)."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK
    return x ^ (x >> 16)


@register
@dataclass
class Random(Policy):
    """Evict a uniformly random entry each step. The draw is a hash of (seed, document, layer, step,
    head, position), so it is reproducible and independent of batching or slot layout."""

    name: ClassVar[str] = "random"
    order: ClassVar[int] = 8
    seed: int = 0
    n_sink: int = 0

    def check_params(self) -> None:
        for key in ("seed", "n_sink"):
            if getattr(self, key) < 0:
                raise ConfigError(f"strategy.params.{key}={getattr(self, key)} must be >= 0")

    def min_budget(self) -> int:
        return self.n_sink + 1

    def scores(self, ctx: StepContext) -> torch.Tensor:
        B, Hkv, _ = ctx.pos.shape
        h = _mix(_mix(self.seed + 0x9E3779B) ^ ctx.doc.view(B, 1, 1))  # (the seed's mix on the host)
        h = _mix(h ^ (ctx.layer * 0x10001 + ctx.t * 0x3F1))
        h = _mix(h ^ torch.arange(Hkv, device=ctx.pos.device).view(1, Hkv, 1))
        h = _mix(h ^ ctx.pos.clamp(min=0))
        draw = h.to(ctx.keys.dtype) / 2**32
        return protect(draw, ctx, n_sink=self.n_sink) if self.n_sink else draw
