"""Agentic groups for the async producer (a `GroupSource`, `rollout/group_source.py`): a prompt's
n agent episodes through the session server (`AgenticRollout.group`), under one limit on the
episodes in flight for the whole run (`agent.concurrency`): as an episode ends the next waiting
one starts, whichever group or step it belongs to. The producer's paced admission bounds how far
ahead groups are admitted; this limit bounds how many episodes run at once.

Each model call of an episode records the weight version it ran under (the session server);
an episode that spans a push keeps running (`pause_mode` retract / in_place), and its leaves'
`weight_versions` hold every version its calls saw."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from miles_core.agents.in_flight import InFlight
from miles_core.agents.rollout import AgenticRollout, step_metrics
from miles_core.rollout.group_source import GroupWork, ProducerState
from miles_core.types import SampleGroup


class EpisodeGroups:
    def __init__(self, rollout: AgenticRollout):
        self.rollout = rollout
        self.limit = rollout.config.agent.concurrency
        self._in_flight: InFlight | None = None

    @contextlib.asynccontextmanager
    async def open(self, state: ProducerState) -> AsyncIterator[None]:
        self._in_flight = InFlight(self.limit)  # its semaphore belongs to this event loop
        yield

    async def generate(self, work: GroupWork) -> SampleGroup:
        assert self._in_flight is not None, "open() first"
        return await self.rollout.group(
            work.step, work.g, work.data_index, work.example, self._in_flight
        )

    def step_metrics(self, step: int, groups: list[SampleGroup]) -> dict[str, float]:
        out = step_metrics(groups, step) | self.rollout.session_counters()
        if self._in_flight is not None:
            out |= self._in_flight.metrics()
        return out
