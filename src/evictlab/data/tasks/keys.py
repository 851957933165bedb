"""Keys that name the needles of the retrieval tasks: two common words joined by a hyphen."""

import numpy as np

FIRST = "amber brave calm dusty eager faint gentle hollow icy jolly lucky misty noble quiet rapid silver"
SECOND = (
    "apple badger candle desert engine falcon garden harbor island jacket kettle lantern meadow orchid "
    "pebble river"
)


def key(rng: np.random.Generator) -> str:
    a, b = FIRST.split(), SECOND.split()
    return f"{a[int(rng.integers(len(a)))]}-{b[int(rng.integers(len(b)))]}"
