from dataclasses import dataclass
from typing import ClassVar

from evictlab.cache.policies import register
from evictlab.cache.policies.base import Policy, StepContext
from evictlab.errors import ConfigError

PARTS = ("key", "value")


@register
@dataclass
class BosAblation(Policy):
    """The full cache with position 0 (BOS, when the stream starts with it) ablated for every later query
    in one layer or all: `part=key` hides its key (each later query's attention renormalises over the
    other keys); `part=value` keeps its key, and the attention it draws, but reads a zero value from it
    (StreamingLLM's softmax-off-by-one question: is BOS a place to park attention, or a bias it adds?).
    Position 0's own states are untouched, so what later layers hold for it is the full cache's.

    Not an eviction policy: it keeps every entry, ignores the budget (one run per seed, like `full`), and
    its KL from the full cache is the ablation's cost. It runs on the parallel path only."""

    name: ClassVar[str] = "bos_ablation"
    label: ClassVar[str] = "full, BOS ablated"
    order: ClassVar[int] = 20
    position_only: ClassVar[bool] = True
    evicts: ClassVar[bool] = False
    ablation: ClassVar[bool] = True
    part: str = "key"
    layer: int = -1  # -1: every layer

    def check_params(self) -> None:
        if self.part not in PARTS:
            raise ConfigError(f"strategy.params.part={self.part!r} must be one of {', '.join(PARTS)}")
        if self.layer < -1:
            raise ConfigError(f"strategy.params.layer={self.layer} must be a layer index, or -1 for all")

    def ablated(self, n_layer: int) -> list[bool]:
        """Per layer: is position 0 ablated there."""
        if self.layer >= n_layer:
            raise ConfigError(f"strategy.params.layer={self.layer}: the model has layers 0 .. {n_layer - 1}")
        return [self.layer in (-1, l) for l in range(n_layer)]

    def static_window(self, budget: int) -> tuple[int, None]:
        return 0, None

    def scores(self, ctx: StepContext):
        raise RuntimeError("bos_ablation keeps every entry")
