"""A weight transport defined outside miles_core, as a user would write one: named by import
path (`weight_sync.transport: tests.plugins.transport:JournaledTransport`) with an option of its
own (`weight_sync.transport_options.journal`), nothing registered inside the package.

It copies the weights in process like the colocated transport and writes one JSON line per push
(version, bytes) to its journal, so a test sees every push the run made through it.
"""

from __future__ import annotations

import json

from pydantic import Field

from miles_core.plugins import PluginOptions
from miles_core.weights.transport import PushStats, TransportContext
from miles_core.weights.transports.colocated import ColocatedTransport


class JournalOptions(PluginOptions):
    journal: str = Field(description="JSON-lines file that gets one line per push")


class JournaledTransport(ColocatedTransport):
    Options = JournalOptions

    @classmethod
    def build(cls, context: TransportContext, options: JournalOptions) -> JournaledTransport:
        transport = cls(bucket_bytes=context.bucket_bytes, dtype=context.dtype)
        transport.journal = options.journal
        return transport

    def push(self, source, version: int, pause_mode: str = "abort") -> PushStats:
        stats = super().push(source, version, pause_mode)
        with open(self.journal, "a") as f:
            f.write(json.dumps({"version": version, "bytes": stats.bytes}) + "\n")
        return stats
