from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext


@register
@dataclass
class TOVA(Policy):
    """Token Omission Via Attention (Oren et al., 2024): evict the entry the current query attends to
    least, averaged over the layer's heads (the paper's choice) or per KV head."""

    name: ClassVar[str] = "tova"
    order: ClassVar[int] = 5
    needs_attention: ClassVar[bool] = True
    per_head: bool = False

    def scores(self, ctx: StepContext) -> torch.Tensor:
        if self.per_head:
            return ctx.attn.clone()
        return ctx.attn.mean(dim=1, keepdim=True).expand_as(ctx.attn).clone()
