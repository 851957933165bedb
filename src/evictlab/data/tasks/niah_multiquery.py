from dataclasses import dataclass
from typing import ClassVar

from evictlab.data.tasks import Problem, Task, digits, distinct, register
from evictlab.data.tasks.keys import key
from evictlab.data.tasks.niah_multikey import INSTRUCTION, NEEDLE


@register
@dataclass
class NiahMultiQuery(Task):
    """RULER's multi-query needle: `n_keys` numbers under different keys, `n_queries` of them asked for at
    once (partial credit: the share named)."""

    name: ClassVar[str] = "niah_multiquery"
    instruction: ClassVar[str] = INSTRUCTION
    n_keys: int = 4
    n_queries: int = 2

    def problem(self, rng):
        keys = distinct(lambda: key(rng), self.n_keys)
        values = distinct(lambda: digits(rng), self.n_keys)
        asked = sorted(rng.choice(self.n_keys, size=self.n_queries, replace=False).tolist())
        names = ", ".join(keys[i] for i in asked[:-1]) + f" and {keys[asked[-1]]}"
        return Problem(
            needles=[NEEDLE.format(k=a, v=b) for a, b in zip(keys, values, strict=True)],
            question=f"What are all the special magic numbers for {names} mentioned in the provided text?",
            reply=f"The special magic numbers for {names} mentioned in the provided text are",
            answer=" " + ", ".join(values[i] for i in asked),
            expected=tuple(values[i] for i in asked),
        )
