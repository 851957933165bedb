from evictlab.eval.engine import StreamOutput, generate, stream
from evictlab.eval.full import FullReference, full_reference
from evictlab.eval.reference import reference_stream
from evictlab.eval.spec import PositionMode, StreamSpec

__all__ = [
    "FullReference",
    "PositionMode",
    "StreamOutput",
    "StreamSpec",
    "full_reference",
    "generate",
    "reference_stream",
    "stream",
]
