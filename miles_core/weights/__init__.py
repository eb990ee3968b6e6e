from miles_core.weights import colocated as _colocated  # noqa: F401  (registers "colocated")
from miles_core.weights.checker import mismatched_tensors, weights_checksum
from miles_core.weights.transport import (
    PushStats,
    WeightTransport,
    make_transport,
    register_transport,
)

__all__ = [
    "PushStats",
    "WeightTransport",
    "make_transport",
    "mismatched_tensors",
    "register_transport",
    "weights_checksum",
]
