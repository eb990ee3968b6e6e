"""The asynchronous rollout producer: a long-lived loop that keeps an engine server busy
while the trainer trains, and hands the trainer whole batches of groups. The loop runs where its
`launch` puts it: a thread of its own by default (`start_thread`), or a long-running task of the
flow (`miles_core/run/loops.py: HostedLoop`, the `rollout_loop` Prefect task).

Group i (0-based over the run) belongs to step i // B (B = prompts per step) and uses the same
prompt order and sampling seeds as a sync run. Admission is paced, not filtered:

- `pace` (default): group i may start once the engine serves version ≥ i // B − max_staleness,
  and the trainer takes groups strictly in index order. A group started at version v is then
  consumed at step i // B ≤ v + max_staleness: staleness never exceeds the bound, nothing is
  dropped or requeued, and long trajectories are consumed exactly where a sync run would consume
  them (drop-and-retry starves them: slime#1800, tinker-cookbook#822).
- `drop` / `retry`: at most (1 + max_staleness) · B groups in flight or waiting; the trainer takes
  groups in completion order; a group staler than the bound is dropped, or its prompt is queued
  again (`retry`). Kept for comparison; both bias the data toward short trajectories.

What a group is comes from a `GroupSource` (`rollout/group_source.py`): a text prompt's n
completions on the engine (`rollout/engine_groups.py`, the default; it also continues requests a
pause-abort interrupted) or a prompt's n agent episodes (`agents/episode_groups.py`). Every
sample records the version of each of its model calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from miles_core.config import RolloutConfig
from miles_core.data import PromptSource
from miles_core.data.tasks import Task
from miles_core.engines.http import HttpEngine
from miles_core.rollout.buffer_state import (
    BUFFER_VERSION,
    check_buffer,
    group_from_json,
    group_to_json,
)
from miles_core.rollout.engine_groups import EngineGroups
from miles_core.rollout.group_source import GroupSource, GroupWork
from miles_core.rollout.mode import MODES, Staleness
from miles_core.rollout.rollout_fn import RolloutResult, rollout_metrics
from miles_core.types import SampleGroup

log = logging.getLogger("miles.producer")


@dataclass
class _Ticket:
    index: int  # global group index
    data_index: int
    example: object
    admitted_version: int
    source_state: dict  # the prompt source's state before this group's prompt was drawn
    group: SampleGroup | None = None
    retries: int = 0
    done_at: float = 0.0
    versions: list[list[int]] = field(default_factory=list)


class ProducerStopped(RuntimeError):
    """Raised to a trainer waiting on groups that a stopped producer will never complete."""


class LoopHandle(Protocol):
    """A started producer loop: `join` waits for it to return (at most `timeout` seconds)."""

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...


# starts `run` (the producer's loop) somewhere; `stop` asks it to return (without waiting)
Launch = Callable[[Callable[[], None], Callable[[], None]], LoopHandle]


def start_thread(run: Callable[[], None], stop: Callable[[], None]) -> LoopHandle:
    """The default `Launch`: a daemon thread "miles-producer" (runtime users without a flow)."""
    thread = threading.Thread(target=run, name="miles-producer", daemon=True)
    thread.start()
    return thread


class RolloutProducer:
    def __init__(
        self,
        engine: HttpEngine,
        tokenizer,
        task: Task,
        source: PromptSource,
        cfg: RolloutConfig,
        version: Callable[[], int],
        first_group: int = 0,
        launch: Launch = start_thread,
        groups: GroupSource | None = None,
        staleness: Staleness | None = None,
    ):
        self.engine = engine  # aborted on stop; `tokenizer` and `task` make the default groups
        self.source = source
        self.cfg = cfg
        self.version = version
        # the bound and policy: the mode's (rollout.mode_options), unless given
        self.staleness = staleness or MODES.get(cfg.mode).staleness(cfg.mode_options)
        self.batch = cfg.prompts_per_step
        self.n = cfg.n_samples_per_prompt
        # what one group is (default: the prompt's n completions on the engine)
        self.groups = groups or EngineGroups(engine, tokenizer, task, cfg)
        self._next_index = first_group  # next group to admit
        self._next_take = first_group  # pace: next group the trainer takes
        self._tickets: dict[int, _Ticket] = {}  # admitted and not yet taken
        self._retry: collections.deque[_Ticket] = collections.deque()
        # restored from a checkpoint while they were generating: they start first (`restore`)
        self._resumed: collections.deque[_Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._held = 0  # > 0: no group starts (a shared-mode evaluation uses the engine)
        self._error: BaseException | None = None
        self.counters = collections.Counter()
        self._last_done = time.monotonic()  # when a group last completed (the watchdog's clock)
        self._launch = launch
        self._loop: LoopHandle | None = None  # the running loop, once started

    # ------------------------------------------------------------------ trainer side
    def start(self) -> RolloutProducer:
        self._loop = self._launch(self._run, self._request_stop)
        return self

    def notify_version(self) -> None:
        """The trainer pushed new weights: admission may move on."""
        with self._cond:
            self._cond.notify_all()

    def take(self, step: int) -> RolloutResult:
        """The B groups of `step`, waiting for them; metrics include staleness and buffer state."""
        t0 = time.perf_counter()
        warned = time.monotonic()
        with self._cond:
            while True:
                self.raise_if_failed()
                picked = self._pick(step)
                if picked is not None:
                    break
                self._raise_if_stopped(f"step {step} waits for its groups")
                now = time.monotonic()
                if now - max(self._last_done, warned) >= self.staleness.watchdog_s:
                    log.warning(self._waiting_on(step, now - self._last_done))
                    warned = now
                self._cond.wait(min(1.0, self.staleness.watchdog_s))
            for t in picked:
                del self._tickets[t.index]
            self._cond.notify_all()
        waited = time.perf_counter() - t0
        groups = []
        for g, t in enumerate(picked):
            assert t.group is not None
            t.group.group_index = g
            groups.append(t.group)
        result = RolloutResult(groups)
        current = self.version()
        result.metrics = (
            rollout_metrics(result.samples, max(waited, 1e-9))
            | self.groups.step_metrics(step, groups)
            | self._metrics(picked, current, waited)
        )
        result.metrics.pop("rollout/tokens_per_s", None)  # not meaningful for a wait
        return result

    def _waiting_on(self, step: int, idle_s: float) -> str:
        """What `take(step)` waits on, for the progress watchdog (called under the lock)."""
        tickets = list(self._tickets.values())
        done = sum(t.group is not None for t in tickets)
        return (
            f"progress watchdog: no rollout group completed for {idle_s:.1f} s; step {step} "
            f"waits for {self.batch} groups; buffer: {done} done, {len(tickets) - done} "
            f"generating, {len(self._retry)} to retry; engine serves version {self.version()} "
            f"(stale_policy {self.staleness.policy}, max_staleness {self.staleness.max_staleness})"
        )

    @contextlib.contextmanager
    def held(self):
        """No new group starts inside this block; groups in flight go on (shared evaluation)."""
        with self._cond:
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def wait_idle(self) -> None:
        """Blocks until no admitted group is still generating."""
        with self._cond:
            while any(t.group is None for t in self._tickets.values()):
                self.raise_if_failed()
                self._raise_if_stopped("a push waits for the groups in flight")
                self._cond.wait(1.0)

    def snapshot(self) -> dict:
        """The buffer for a checkpoint (`rollout/buffer_state.py`), consistent under the lock:
        groups admitted and not yet taken (completed: with their samples; generating: by
        identity), the retry queue, and the prompt position after all of them (`source_state`,
        the run's data position while this producer runs)."""
        with self._cond:
            tickets = sorted(self._tickets.values(), key=lambda t: t.index)
            retry = list(self._retry)
            done = sorted((t for t in tickets if t.group is not None), key=lambda t: t.done_at)
            groups = [(t, t.group) for t in tickets] + [(t, None) for t in retry]
            frozen = {
                "next_index": self._next_index,
                "next_take": self._next_take,
                "source_state": self.source.state(),
                "counters": dict(self.counters),
            }
        order = {t.index: i for i, t in enumerate(done)}
        return frozen | {
            "version": BUFFER_VERSION,
            "prompts_per_step": self.batch,
            "n_samples_per_prompt": self.n,
            "stale_policy": self.staleness.policy,
            "groups": [
                {
                    "index": t.index,
                    "data_index": t.data_index,
                    "admitted_version": t.admitted_version,
                    "source_state": t.source_state,
                    "retries": t.retries,
                    "state": "retry" if i >= len(tickets) else "done" if g else "generating",
                    "done_order": order.get(t.index) if g else None,
                    "group": group_to_json(g) if g else None,
                }
                for i, (t, g) in enumerate(groups)
            ],
        }

    def restore(self, data: dict) -> None:
        """Before `start`: continues a checkpoint's buffer (`snapshot`). Completed groups are
        handed to the trainer as they are; generating ones start again first (same rids and
        seeds), then the retry queue; new prompts continue after the last admitted one."""
        check_buffer(data, self.batch, self.n, self.staleness.policy)
        if self._loop is not None:
            raise RuntimeError("RolloutProducer.restore must come before start()")
        with self._cond:
            self._next_index = int(data["next_index"])
            self._next_take = int(data["next_take"])
            self.source.load_state(data["source_state"])
            self.counters.update(data.get("counters", {}))
            now = time.monotonic()
            for item in data["groups"]:
                example = self.source.examples[int(item["data_index"])]
                ticket = _Ticket(
                    index=int(item["index"]),
                    data_index=int(item["data_index"]),
                    example=example,
                    admitted_version=int(item["admitted_version"]),
                    source_state=item["source_state"],
                    retries=int(item["retries"]),
                )
                if item["state"] == "retry":
                    self._retry.append(ticket)
                    continue
                self._tickets[ticket.index] = ticket
                if item["state"] == "done":
                    ticket.group = group_from_json(item["group"], example)
                    ticket.done_at = now + 1e-6 * int(item["done_order"])  # completion order
                else:
                    self._resumed.append(ticket)

    def stop(self) -> None:
        self._request_stop()
        if self._loop is not None:
            self._loop.join(timeout=30)

    def _request_stop(self) -> None:
        """The loop returns soon: no group starts any more, the engine's requests are aborted."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        with contextlib.suppress(Exception):
            self.engine.abort()

    # ------------------------------------------------------------------ selection
    def _pick(self, step: int) -> list[_Ticket] | None:
        if self.staleness.policy == "pace":
            first = step * self.batch
            wanted = [self._tickets.get(i) for i in range(first, first + self.batch)]
            if all(t is not None and t.group is not None for t in wanted):
                return wanted  # type: ignore[return-value]
            return None
        ready = sorted(
            (t for t in self._tickets.values() if t.group is not None), key=lambda t: t.done_at
        )
        current = self.version()
        keep = []
        for t in ready:
            if current - t.admitted_version > self.staleness.max_staleness:
                del self._tickets[t.index]
                self.counters["stale_groups"] += 1
                if self.staleness.policy == "retry":
                    t.group, t.retries = None, t.retries + 1
                    self._retry.append(t)
                self._cond.notify_all()
                continue
            keep.append(t)
        return keep[: self.batch] if len(keep) >= self.batch else None

    def _may_admit(self) -> bool:
        if self._held:
            return False
        if self.staleness.policy == "pace":
            return self.version() >= self._next_index // self.batch - self.staleness.max_staleness
        return len(self._tickets) < (1 + self.staleness.max_staleness) * self.batch

    def _may_resume(self) -> bool:
        return bool(self._resumed) and not self._held

    def _raise_if_stopped(self, waiter: str) -> None:
        """A stopped producer completes no group: whoever waits for one is told, not left hanging
        (a run stopping while its trainer waits)."""
        if self._stop:
            raise ProducerStopped(f"the rollout producer was stopped; {waiter}")

    def raise_if_failed(self) -> None:
        """Raises what ended the producer's loop, if it failed (e.g. the engine died)."""
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._error!r}") from self._error

    # ------------------------------------------------------------------ producer loop
    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001  (handed to the trainer in `take`)
            log.exception("rollout producer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    async def _produce(self) -> None:
        async with self.groups.open(self):
            running: set[asyncio.Task] = set()
            while True:
                ticket = await asyncio.to_thread(self._admit_next)
                if ticket is None:
                    break
                task = asyncio.create_task(self._generate(ticket))
                running.add(task)
                task.add_done_callback(self._finished)
                task.add_done_callback(running.discard)
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _finished(self, task: asyncio.Task) -> None:
        """A group's generation failed (e.g. the engine died): the trainer's `take` raises it."""
        if not task.cancelled() and task.exception() is not None:
            with self._cond:
                self._error = self._error or task.exception()
                self._cond.notify_all()

    def _admit_next(self) -> _Ticket | None:
        """Blocks until a group may start (or the producer stops); draws its prompt."""
        with self._cond:
            while not self._stop and not self._may_resume() and not self._may_admit():
                self._cond.wait(1.0)
            if self._stop:
                return None
            if self._may_resume():  # admitted before the checkpoint: no pacing again
                ticket = self._resumed.popleft()
                ticket.admitted_version = self.version()
                return ticket
            if self._retry:
                ticket = self._retry.popleft()
                ticket.admitted_version = self.version()
            else:
                state = self.source.state()
                (data_index, example) = self.source.next_batch(1)[0]
                ticket = _Ticket(
                    index=self._next_index,
                    data_index=data_index,
                    example=example,
                    admitted_version=self.version(),
                    source_state=state,
                )
                self._next_index += 1
            self._tickets[ticket.index] = ticket
            self.counters["admitted_groups"] += 1
            return ticket

    async def _generate(self, ticket: _Ticket) -> None:
        step, g = divmod(ticket.index, self.batch)
        work = GroupWork(ticket.index, step, g, ticket.data_index, ticket.example)  # type: ignore[arg-type]
        group = await self.groups.generate(work)
        with self._cond:
            ticket.group = group
            ticket.done_at = self._last_done = time.monotonic()
            self._cond.notify_all()

    # ProducerState (what the group source reads)
    def stopping(self) -> bool:
        return self._stop

    # ------------------------------------------------------------------ metrics
    def _metrics(self, picked: list[_Ticket], current: int, waited: float) -> dict[str, float]:
        stale = [current - min(s.weight_versions) for t in picked for s in t.group.samples]  # type: ignore[union-attr]
        mixed = [len(set(s.weight_versions)) > 1 for t in picked for s in t.group.samples]  # type: ignore[union-attr]
        with self._cond:
            in_buffer = sum(1 for t in self._tickets.values() if t.group is not None)
            in_flight = sum(1 for t in self._tickets.values() if t.group is None)
        return {
            "rollout/staleness/mean": sum(stale) / len(stale),
            "rollout/staleness/max": float(max(stale)),
            "rollout/weight_version/mixed_version_ratio": sum(mixed) / len(mixed),
            "buffer/size": float(in_buffer),
            "buffer/in_flight_groups": float(in_flight),
            "buffer/stale_groups_total": float(self.counters["stale_groups"]),
            "rollout/continued_requests_total": float(self.counters["continued_requests"]),
            "perf/rollout_wait_time_s": waited,
        }
