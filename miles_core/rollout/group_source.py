"""The seam between the async rollout producer and what one group is: the producer
(`rollout/producer.py`) admits groups, buffers them, hands whole steps to the trainer and
checkpoints its buffer; a `GroupSource` generates one admitted group and says what a step of its
groups reports. Two implementations: `rollout/engine_groups.py` (a prompt's n completions on the
engine, the text tasks) and `agents/episode_groups.py` (a prompt's n agent episodes through the
session server). A new kind of group is a new file with these three methods."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from miles_core.data.tasks import Example
from miles_core.types import SampleGroup


@dataclass(frozen=True)
class GroupWork:
    """One admitted group: global index `index` (step `step` = index // B, position `g` in it),
    its prompt (`data_index` into the run's prompts, `example`)."""

    index: int
    step: int
    g: int
    data_index: int
    example: Example


class ProducerState(Protocol):
    """What a group source may read of the producer running it."""

    counters: collections.Counter

    def version(self) -> int:
        """The weight version the engines serve now."""
        ...

    def stopping(self) -> bool:
        """The producer is stopping: an interrupted call is not continued."""
        ...


class GroupSource(Protocol):
    def open(self, state: ProducerState) -> contextlib.AbstractAsyncContextManager[None]:
        """The resources of one producer loop (HTTP clients, a limit on calls in flight),
        made inside the loop's event loop and closed when it ends."""
        ...

    async def generate(self, work: GroupWork) -> SampleGroup:
        """The group's samples, each with `weight_versions`: the version of each of its model
        calls, in order. A failure of one sample or episode is that sample's (FAILED, masked);
        raising ends the producer (the trainer's `take` re-raises it)."""
        ...

    def step_metrics(self, step: int, groups: list[SampleGroup]) -> dict[str, float]:
        """Metrics of step `step`'s groups beyond the producer's own (staleness, buffer) and
        `rollout_metrics`; also for groups restored from a checkpoint."""
        ...


class HookedGroups:
    """A group source whose groups each pass through `hooks` (blocking calls on one group, run
    in a worker thread so the producer's loop goes on) before the producer buffers them."""

    def __init__(self, inner: GroupSource, hooks: list[Callable[[SampleGroup], None]]):
        self.inner = inner
        self.hooks = hooks

    def open(self, state: ProducerState) -> contextlib.AbstractAsyncContextManager[None]:
        return self.inner.open(state)

    async def generate(self, work: GroupWork) -> SampleGroup:
        group = await self.inner.generate(work)
        for hook in self.hooks:
            await asyncio.to_thread(hook, group)
        return group

    def step_metrics(self, step: int, groups: list[SampleGroup]) -> dict[str, float]:
        return self.inner.step_metrics(step, groups)
