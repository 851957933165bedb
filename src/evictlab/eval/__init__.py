from evictlab.eval.engine import FullReference, PositionMode, StreamOutput, full_reference, stream
from evictlab.eval.reference import reference_stream

__all__ = ["FullReference", "PositionMode", "StreamOutput", "full_reference", "reference_stream", "stream"]
