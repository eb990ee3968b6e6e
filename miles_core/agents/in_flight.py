"""A limit on agent episodes in flight that also measures them: how many run now, and their
time-weighted mean since the last read (`rollout/active_episodes*`)."""

from __future__ import annotations

import asyncio
import threading
import time


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

    def metrics(self) -> dict[str, float]:
        """`rollout/active_episodes` (running now), `_mean` (time-weighted since the last
        read) and `_fraction` (that mean over the limit)."""
        active, mean = self.read()
        return {
            "rollout/active_episodes": float(active),
            "rollout/active_episodes_mean": mean,
            "rollout/active_episodes_fraction": mean / self.limit,
        }
