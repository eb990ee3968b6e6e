"""Weight sync: the transport protocol (transport.py) and its built-ins (transports/), how a
transport reads the trainer (source.py), what engine servers run to receive (receiver.py, shm.py),
and the run's side of it (sync.py)."""

from miles_core.weights.checker import mismatched_tensors, weights_checksum
from miles_core.weights.transport import TRANSPORTS, PushStats, TransportContext, WeightTransport

__all__ = [
    "TRANSPORTS",
    "PushStats",
    "TransportContext",
    "WeightTransport",
    "mismatched_tensors",
    "weights_checksum",
]
