from miles_core.weights import broadcast as _broadcast  # noqa: F401
from miles_core.weights import colocated as _colocated  # noqa: F401  (registers transports)
from miles_core.weights import disk as _disk  # noqa: F401
from miles_core.weights import p2p as _p2p  # noqa: F401
from miles_core.weights import shared_memory as _shared_memory  # noqa: F401
from miles_core.weights.checker import mismatched_tensors, weights_checksum
from miles_core.weights.transport import (
    PushStats,
    WeightTransport,
    make_transport,
    register_transport,
    transport_names,
    transport_route,
)

__all__ = [
    "PushStats",
    "WeightTransport",
    "make_transport",
    "mismatched_tensors",
    "register_transport",
    "transport_names",
    "transport_route",
    "weights_checksum",
]
