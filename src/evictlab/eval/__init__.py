"""The streaming engine (engine.py: `stream`, `generate`), the full-cache reference (full.py), the naive
loop it is tested against (naive.py) and the settings they share (spec.py).

The names below load on first use (PEP 562), so that importing one light module of the package, as the
config does with `evictlab.eval.spec`, does not load the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "FullReference": "full",
    "PositionMode": "spec",
    "StreamOutput": "paths",
    "StreamSpec": "spec",
    "full_reference": "full",
    "generate": "engine",
    "naive_stream": "naive",
    "stream": "engine",
}
__all__ = [
    "FullReference",
    "PositionMode",
    "StreamOutput",
    "StreamSpec",
    "full_reference",
    "generate",
    "naive_stream",
    "stream",
]

if TYPE_CHECKING:
    from evictlab.eval.engine import generate, stream
    from evictlab.eval.full import FullReference, full_reference
    from evictlab.eval.naive import naive_stream
    from evictlab.eval.paths import StreamOutput
    from evictlab.eval.spec import PositionMode, StreamSpec


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'evictlab.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"evictlab.eval.{_WHERE[name]}"), name)
