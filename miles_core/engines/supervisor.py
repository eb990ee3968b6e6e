"""Engine health: a heartbeat thread that replaces a dead or hung engine server, and the
re-issue rule for the requests it was serving.

`EngineSupervisor` polls the engine every `interval_s`: a process that exited is dead at once;
a live one is dead after `timeout_s` without a 200 from `/health` (a hung process, e.g.
SIGSTOP). A dead engine is killed by PID (a hung one must never answer again), a fresh process
is started on the same port (every client's URL stays valid), and `serve_weights` — the owner
of the weights, `WeightSync` (weights/sync.py) — reconnects the weight transport and pushes the
current weights and version. Only then does the engine count as serving again (`generation` + 1). After
`max_restarts` replacements the next death fails the run with a clear message.

Clients never retry blindly: `reissue_once` runs a call; if it fails because the engine died,
it waits for the replacement and runs it exactly once more (same rid, same sampling seed). A
call that fails again, or fails while the engine stayed healthy, raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from miles_core.processes.managed import ManagedProcess, ProcessUnavailable

log = logging.getLogger("miles.engine")
T = TypeVar("T")

SERVING, REPLACING, FAILED = "serving", "replacing", "failed"


@dataclass(frozen=True)
class Replacement:
    """One replaced engine: why, and how long each phase took (monotonic seconds)."""

    reason: str
    old_pid: int | None
    new_pid: int | None
    detected_at: float  # when the supervisor declared the engine dead
    started_s: float  # new process healthy, after detection
    weights_s: float  # weights pushed and version set, after the start

    @property
    def recovery_s(self) -> float:
        return self.started_s + self.weights_s


class EngineSupervisor:
    """Keeps one engine server process serving; see the module docstring."""

    def __init__(
        self,
        process: ManagedProcess,
        serve_weights: Callable[[], None],
        interval_s: float = 1.0,
        timeout_s: float = 6.0,
        max_restarts: int = 3,
        start_timeout_s: float = 120.0,
        on_dead: Callable[[str], None] | None = None,
    ):
        """`on_dead(url)`: called when the engine is declared dead, before it is replaced
        (e.g. taking it out of a router's rotation)."""
        self.process = process
        self.on_dead = on_dead
        self.serve_weights = serve_weights
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.generation = 0  # replacements completed; clients compare it before and after a call
        self.attempts = 0  # process starts tried, successful or not
        self.reissued = 0  # calls re-issued on a replacement
        self.replacements: list[Replacement] = []
        self.state = SERVING
        self.failure: str | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._probe_client = httpx.Client(timeout=max(0.5, interval_s))
        self._thread = threading.Thread(target=self._run, name="miles-engine-health", daemon=True)

    @property
    def url(self) -> str:
        return self.process.url

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineSupervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the heartbeat (before the owner stops the engine process, or it would be
        replaced); waits for a replacement under way to finish its current phase."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.start_timeout_s + 30)
        self._probe_client.close()

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/engine_restarts_total": float(self.generation),
            "rollout/reissued_requests_total": float(self.reissued),
        }

    # ------------------------------------------------------------------ client side
    def count_reissue(self) -> None:
        with self._cond:
            self.reissued += 1

    def settled(self, seen: int) -> bool | None:
        """True once a replacement after `seen` serves, None while one is under way or due,
        False while the engine `seen` is still considered healthy. Raises when given up."""
        if self.state == FAILED:
            raise ProcessUnavailable(self.failure)
        if self.state == SERVING and self.generation > seen:
            return True
        return None if self.state == REPLACING else False

    def wait_serving(self, timeout: float | None = None) -> int:
        """Blocks while a replacement is under way; returns the generation that serves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.state == REPLACING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ProcessUnavailable(f"engine at {self.url} is still being replaced")
                self._cond.wait(left if left is not None else 1.0)
            self.settled(self.generation)
            return self.generation

    def wait_for_replacement(self, seen: int, error: BaseException) -> None:
        """After a call made at generation `seen` failed with `error`: returns once a
        replacement serves; re-raises `error` if the engine stays healthy for a full health
        timeout (the failure was not the engine's death); raises if replacement gave up."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        with self._cond:
            while True:
                settled = self.settled(seen)
                if settled:
                    return
                left = deadline - time.monotonic()
                if settled is False and left <= 0:
                    raise error
                self._cond.wait(min(1.0, left) if settled is False else 1.0)

    async def await_serving(self) -> int:
        while True:
            with self._cond:
                if self.state != REPLACING:
                    self.settled(self.generation)
                    return self.generation
            await asyncio.sleep(0.05)

    async def await_replacement(self, seen: int, error: BaseException) -> EngineSupervisor:
        """`wait_for_replacement` for the event loop (polls; holds no thread); returns itself,
        the engine that was replaced."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        while True:
            with self._cond:
                settled = self.settled(seen)
            if settled:
                return self
            if settled is False and time.monotonic() > deadline:
                raise error
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ heartbeat
    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval_s):
            reason, exited = self._probe()
            now = time.monotonic()
            if reason is None:
                last_ok = now
                continue
            silent = now - last_ok
            if not exited and silent < self.timeout_s:
                continue
            self._replace(reason if exited else f"{reason} (no healthy answer for {silent:.1f} s)")
            if self.state == FAILED:
                return
            last_ok = time.monotonic()

    def _probe(self) -> tuple[str | None, bool]:
        """(None, False) when healthy, else (what is wrong, whether the process exited)."""
        proc = self.process.proc
        if proc is not None and proc.poll() is not None:
            return f"process {proc.pid} exited with code {proc.returncode}", True
        try:
            r = self._probe_client.get(f"{self.url}/health")
        except httpx.HTTPError as e:
            return f"/health failed: {e!r}", False
        return (None, False) if r.status_code == 200 else (f"/health: HTTP {r.status_code}", False)

    # ------------------------------------------------------------------ replacement
    def _replace(self, reason: str) -> None:
        detected = time.monotonic()
        old_pid = self.process.pid
        with self._cond:
            self.state = REPLACING
            self._cond.notify_all()
        log.warning("engine server %s (pid %s) is dead: %s", self.url, old_pid, reason)
        if self.on_dead is not None:
            self.on_dead(self.url)
        self._kill()  # a hung process must not answer again; its connections break now
        last_error: BaseException | None = None
        while not self._stop.is_set():
            if self.attempts >= self.max_restarts:
                self._give_up(reason, last_error)
                return
            self.attempts += 1
            try:
                self.process.start(timeout=self.start_timeout_s)
                started = time.monotonic()
                if self._stop.is_set():
                    return  # the owner is shutting down and stops the process
                self.serve_weights()
            except Exception as e:  # noqa: BLE001  (a failed start or push is another attempt)
                last_error = e
                log.warning(
                    "replacement attempt %d/%d of the engine server %s failed: %r",
                    self.attempts,
                    self.max_restarts,
                    self.url,
                    e,
                )
                self._kill()
                continue
            done = time.monotonic()
            event = Replacement(
                reason, old_pid, self.process.pid, detected, started - detected, done - started
            )
            log.warning(
                "engine server %s replaced: pid %s -> %s, healthy %.1f s after detection, "
                "weights pushed in %.2f s (restart %d of at most %d)",
                self.url,
                old_pid,
                event.new_pid,
                event.started_s,
                event.weights_s,
                self.generation + 1,
                self.max_restarts,
            )
            with self._cond:
                self.replacements.append(event)
                self.generation += 1
                self.state = SERVING
                self._cond.notify_all()
            return

    def _kill(self) -> None:
        proc = self.process.proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            proc.wait(timeout=30)

    def _give_up(self, reason: str, last_error: BaseException | None) -> None:
        tail = f"; last replacement attempt: {last_error!r}" if last_error else ""
        message = (
            f"engine server at {self.url} died ({reason}) and is not replaced again: "
            f"{self.attempts} of rollout.engine_options.max_engine_restarts={self.max_restarts} "
            "replacement "
            f"attempt(s) used{tail}"
        )
        log.error(message)
        with self._cond:
            self.failure = message
            self.state = FAILED
            self._cond.notify_all()


async def reissue_once(
    supervisor: EngineSupervisor | RoutedSupervision | None,
    call: Callable[[], Awaitable[T]],
    what: str,
) -> T:
    """Runs `call` (an engine request); if it fails because the engine died, waits for the
    replacement and runs it exactly once more. A second failure raises, naming `what`."""
    if supervisor is None:
        return await call()
    seen = await supervisor.await_serving()
    try:
        return await call()
    except ProcessUnavailable as first:
        replaced = await supervisor.await_replacement(seen, first)
    replaced.count_reissue()
    log.info("re-issuing %s after the engine server %s was replaced", what, replaced.url)
    try:
        return await call()
    except ProcessUnavailable as second:
        raise ProcessUnavailable(
            f"{what} failed again after the engine server was replaced (re-issued once, not "
            f"again): {second}"
        ) from second


def replaced_since(
    supervisors: list[EngineSupervisor], seen: list[int]
) -> EngineSupervisor | bool | None:
    """`EngineSupervisor.settled` over several engines, supervisor i last seen serving
    generation `seen[i]`: the first engine replaced since, once none is being replaced; None
    while one is; False while every one still serves what it served."""
    states = [s.settled(g) for s, g in zip(supervisors, seen, strict=True)]
    if None in states:
        return None
    return supervisors[states.index(True)] if True in states else False


class RoutedSupervision:
    """The supervisors of the engine servers behind one router, as one for `reissue_once`. The
    router itself sends a call to another engine when its engine is gone before the call
    reaches it; a call that dies while its engine serves it comes back as an error (HTTP 500).
    Such a call waits until every engine replaced since serves again, then goes through the
    router once more. The re-issue counts on the engine that was replaced."""

    def __init__(self, supervisors: list[EngineSupervisor]):
        self.members = list(supervisors)

    async def await_serving(self) -> list[int]:
        return [await s.await_serving() for s in self.members]

    async def await_replacement(self, seen: list[int], error: BaseException) -> EngineSupervisor:
        deadline = time.monotonic() + max(s.timeout_s + 2 * s.interval_s for s in self.members)
        while True:
            replaced = replaced_since(self.members, seen)
            if replaced:
                return replaced
            if replaced is False and time.monotonic() > deadline:
                raise error
            await asyncio.sleep(0.05)
