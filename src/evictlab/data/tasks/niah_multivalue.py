from dataclasses import dataclass
from typing import ClassVar

from evictlab.data.tasks import Problem, Task, digits, distinct, register
from evictlab.data.tasks.keys import key
from evictlab.data.tasks.niah_multikey import INSTRUCTION, NEEDLE


@register
@dataclass
class NiahMultiValue(Task):
    """RULER's multi-value needle: `n_values` numbers planted under one key, all asked for (partial
    credit: the share named)."""

    name: ClassVar[str] = "niah_multivalue"
    instruction: ClassVar[str] = INSTRUCTION
    n_values: int = 4

    def problem(self, rng):
        k = key(rng)
        values = distinct(lambda: digits(rng), self.n_values)
        return Problem(
            needles=[NEEDLE.format(k=k, v=v) for v in values],
            question=f"What are all the special magic numbers for {k} mentioned in the provided text?",
            reply=f"The special magic numbers for {k} mentioned in the provided text are",
            answer=" " + ", ".join(values),
            expected=tuple(values),
        )
