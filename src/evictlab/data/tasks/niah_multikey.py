from dataclasses import dataclass
from typing import ClassVar

from evictlab.data.tasks import Problem, Task, digits, distinct, register
from evictlab.data.tasks.keys import key

NEEDLE = " One of the special magic numbers for {k} is: {v}. "
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)


@register
@dataclass
class NiahMultiKey(Task):
    """RULER's multi-key needle: `n_keys` numbers under different keys, one asked for."""

    name: ClassVar[str] = "niah_multikey"
    instruction: ClassVar[str] = INSTRUCTION
    partial: ClassVar[bool] = False
    n_keys: int = 4

    def problem(self, rng):
        keys = distinct(lambda: key(rng), self.n_keys)
        values = distinct(lambda: digits(rng), self.n_keys)
        i = int(rng.integers(self.n_keys))
        k, v = keys[i], values[i]
        return Problem(
            needles=[NEEDLE.format(k=a, v=b) for a, b in zip(keys, values, strict=True)],
            question=f"What is the special magic number for {k} mentioned in the provided text?",
            reply=f"The special magic number for {k} mentioned in the provided text is",
            answer=f" {v}",
            expected=(v,),
        )
