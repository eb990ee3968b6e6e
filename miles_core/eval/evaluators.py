"""The three evaluation modes behind one interface: `submit` a job, collect `finished` outcomes.

- shared: the job runs at once, on the caller's thread, on the rollout engine (the producer is
  held meanwhile);
- dedicated: a worker thread starts an engine server from the version's checkpoint, scores it
  and stops it; training keeps going;
- external: a worker thread POSTs the checkpoint URI and version to an evaluation service and
  polls for the result (contract in `miles_core/eval/service.py`).

Every outcome carries the policy version it measured and the weights' sha256 the evaluator
reports. A job that raises or runs past its timeout becomes an outcome with `error` set: an
evaluation never stops training.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("miles.eval")


@dataclass(frozen=True)
class EvalJob:
    version: int  # policy version = training steps behind it; its scores are logged at this step
    weights_sha256: str | None = None  # the weights the job is meant to measure
    checkpoint_uri: str | None = None  # dedicated / external
    model_version: str | None = None  # the registered model version of that checkpoint


@dataclass
class EvalOutcome:
    job: EvalJob
    metrics: dict[str, float] = field(default_factory=dict)
    measured_sha256: str | None = None
    error: str | None = None
    seconds: float = 0.0
    version_at_end: int = 0  # the policy version training had reached when the job ended


# runs one job before `deadline` (time.monotonic()); returns (eval/* metrics, measured sha256)
JobRunner = Callable[[EvalJob, float], tuple[dict[str, float], str | None]]


def _run(
    runner: JobRunner, job: EvalJob, timeout_s: float, clock: Callable[[], int]
) -> EvalOutcome:
    t0 = time.monotonic()
    try:
        metrics, sha = runner(job, t0 + timeout_s)
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:g} s")
        outcome = EvalOutcome(job, metrics, sha)
    except Exception as e:  # noqa: BLE001  (an evaluation never stops training)
        outcome = EvalOutcome(job, error=f"{type(e).__name__}: {e}")
        log.warning("evaluation of policy version %d failed: %s", job.version, outcome.error)
    outcome.seconds = time.monotonic() - t0
    outcome.version_at_end = clock()
    return outcome


class SharedEvaluator:
    """Runs each job now, on the caller's thread (between training steps)."""

    background = False

    def __init__(self, runner: JobRunner, timeout_s: float, clock: Callable[[], int] = lambda: 0):
        self.runner = runner
        self.timeout_s = timeout_s
        self.clock = clock  # the policy version training has reached
        self._done: list[EvalOutcome] = []
        self._cond = threading.Condition()

    def fail(self, job: EvalJob, reason: str) -> None:
        """Records `job` as not evaluated, with the reason."""
        log.warning("evaluation of policy version %d: %s", job.version, reason)
        with self._cond:
            self._done.append(EvalOutcome(job, error=reason, version_at_end=self.clock()))

    def submit(self, job: EvalJob) -> None:
        """Runs the job here, not on an abandoned thread: a shared evaluation uses the rollout
        engine (and holds the producer), so it must be over before training goes on. Its
        requests are bounded by the engine's own timeouts; one that ends past `timeout_s`
        is still logged as timed out."""
        outcome = _run(self.runner, job, self.timeout_s, self.clock)
        with self._cond:
            self._done.append(outcome)

    def finished(self, wait: bool = False) -> list[EvalOutcome]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass


class BackgroundEvaluator(SharedEvaluator):
    """One worker thread runs jobs in order while training goes on; at most `max_in_flight`
    are pending or running, more are skipped (an outcome with the reason). Runners must keep
    to their deadline (every call they make has a timeout) and clean up what they start."""

    background = True

    def __init__(
        self,
        runner: JobRunner,
        timeout_s: float,
        max_in_flight: int,
        name: str,
        clock: Callable[[], int] = lambda: 0,
    ):
        super().__init__(runner, timeout_s, clock)
        self.max_in_flight = max_in_flight
        self._jobs: queue.Queue[EvalJob | None] = queue.Queue()
        self._pending = 0
        self._thread = threading.Thread(target=self._work, name=f"miles-eval-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: EvalJob) -> None:
        with self._cond:
            busy = self._pending >= self.max_in_flight
            if not busy:
                self._pending += 1
        if busy:
            self.fail(
                job,
                f"skipped: {self.max_in_flight} evaluations pending (eval.mode_options.max_in_flight)",
            )
            return
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            outcome = _run(self.runner, job, self.timeout_s, self.clock)
            with self._cond:
                self._done.append(outcome)
                self._pending -= 1
                self._cond.notify_all()

    def finished(self, wait: bool = False) -> list[EvalOutcome]:
        """The outcomes so far; with `wait`, first waits for every pending job (each is bounded
        by its timeout)."""
        with self._cond:
            if wait:
                deadline = time.monotonic() + self.timeout_s * (self._pending + 1)
                while self._pending and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Jobs not started yet are recorded as skipped; the one running finishes (runners
        with a `close` stop early when their owner closes them first)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._cond:
                    self._pending -= 1
                self.fail(job, "skipped: the run ended before this evaluation started")
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)
