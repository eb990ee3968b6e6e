"""Agentic groups for the async producer (a `GroupSource`, `rollout/group_source.py`): a prompt's
n agent episodes through the session server (`AgenticRollout.group`), under one limit on the
episodes in flight for the whole run (`agent.concurrency`): as an episode ends the next waiting
one starts, whichever group or step it belongs to. The producer's paced admission bounds how far
ahead groups are admitted; this limit bounds how many episodes run at once.

Each model call of an episode records the weight version it ran under (the session server);
an episode that spans a push keeps running (`pause_mode` retract / in_place), and its leaves'
`weight_versions` hold every version its calls saw."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from miles_core.agents.rollout import AgenticRollout, step_metrics
from miles_core.rollout.group_source import GroupWork, ProducerState
from miles_core.types import SampleGroup


class InFlight:
    """A limit on episodes in flight that also measures them: how many run now, and their
    time-weighted mean since the last `read`."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)
        self._lock = threading.Lock()  # read from the trainer's thread
        self._active = 0
        self._area = 0.0  # episode-seconds since the last read
        self._since = self._last = time.monotonic()

    def _move(self, delta: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._area += self._active * (now - self._last)
            self._active += delta
            self._last = now

    async def __aenter__(self) -> None:
        await self._sem.acquire()
        self._move(+1)

    async def __aexit__(self, *exc) -> None:
        self._move(-1)
        self._sem.release()

    def read(self) -> tuple[int, float]:
        """(episodes running now, their mean number since the last read)."""
        self._move(0)
        with self._lock:
            span = self._last - self._since
            mean = self._area / span if span > 0 else float(self._active)
            self._area, self._since = 0.0, self._last
            return self._active, mean


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
            active, mean = self._in_flight.read()
            out["rollout/active_episodes"] = float(active)
            out["rollout/active_episodes_mean"] = mean
            out["rollout/active_episodes_fraction"] = mean / self.limit
        return out
