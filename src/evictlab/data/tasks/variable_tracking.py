import string
from dataclasses import dataclass
from typing import ClassVar

from evictlab.data.tasks import Problem, Task, digits, distinct, register


@register
@dataclass
class VariableTracking(Task):
    """RULER's variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... (`hops` assignments after the
    first) planted in order, and a distractor chain with another value; asked for every variable that
    holds the first chain's value (partial credit: the share named)."""

    name: ClassVar[str] = "variable_tracking"
    instruction: ClassVar[str] = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text."
    )
    item: ClassVar[str] = r"[A-Z]{5}"
    hops: int = 4
    chains: int = 2

    def problem(self, rng):
        letters = list(string.ascii_uppercase)
        n = self.hops + 1
        names = distinct(lambda: "".join(rng.choice(letters, size=5)), n * self.chains)
        values = distinct(lambda: digits(rng, 5), self.chains)
        chains = []
        for c in range(self.chains):
            own = names[c * n : (c + 1) * n]
            chains.append(
                [f" VAR {own[0]} = {values[c]}. "]
                + [f" VAR {b} = VAR {a}. " for a, b in zip(own, own[1:], strict=False)]
            )
        needles = [s for step in zip(*chains, strict=True) for s in step]  # interleaved, each chain in order
        asked = names[:n]
        ask = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
        return Problem(
            needles=needles,
            question=ask,
            reply=(
                "According to the chain(s) of variable assignment in the text above, "
                f"{n} variables are assigned the value {values[0]}, they are:"
            ),
            answer=" " + " ".join(asked),
            expected=tuple(asked),
        )
