from evictlab.eval.engine import StreamOutput, generate, stream
from evictlab.eval.full import FullReference, full_reference
from evictlab.eval.naive import naive_stream
from evictlab.eval.spec import PositionMode, StreamSpec

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
