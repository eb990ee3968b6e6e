"""A run as long-running loops around one `RLRuntime`, for a flow that runs each loop as a
concurrent task (`flows/rl_loops.py`); nothing here knows about Prefect. A loop exists only
where it has work to do beside the trainer:

    train     every step: take the rollout → train → push → save → StepLog → evaluate
    rollout   (a mode with a producer) hosts the producer's loop (`RolloutProducer._run`)
    weights   (pushes that overlap training: fully_async with a transport that pushes a
              snapshot) pushes each policy the trainer hands over as a `WeightSnapshot`, while
              the trainer trains the next step; the trainer collects the push before handing
              over the next one, and at save and evaluation steps before going on
    evaluate  (background evaluations: dedicated, external) submits the versions due and logs
              the finished ones as the trainer goes on, and waits for the pending ones once
              training ended

Otherwise the trainer does the step's phases itself, in the sync loop's order
(`flows/rl_train.py`): sync and one_step_off push in line (one_step_off's push waits for the
batch in flight anyway), shared evaluations run on the rollout engine between steps. A step
whose push overlaps the next one is logged when its push is collected, with its own time (up
to the hand-over) and its push's metrics; the versions, checkpoints and evaluated policies are
those of the one-thread loop.

A loop that raises ends the run: the first error is kept (`error`), every loop waiting on a
hand-over gets `Stopped` and returns, the producer is asked to stop, and the flow re-raises the
error. The phases are the flow's step functions (`Phases`: its Prefect tasks, or plain calls).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_core.run.runtime import RLRuntime
from miles_core.run.steplog import StepLog

log = logging.getLogger("miles.loops")
_END = object()  # the trainer's last hand-over


class Stopped(Exception):
    """Another loop failed: this one returns without finishing its work."""


@dataclass(frozen=True)
class Phases:
    """The step functions the loops call, with the sync loop's signatures (tasks/)."""

    rollout: Callable[[RLRuntime, int], Any]  # → RolloutResult with perf/rollout_time_s
    train: Callable[[RLRuntime, Any], dict[str, float]]
    push: Callable[..., dict[str, float]]  # (rt[, snapshot])
    save: Callable[..., dict[str, float]]  # (rt, step[, metrics])
    evaluate: Callable[[RLRuntime, int], None]
    collect: Callable[..., list[tuple[int, dict[str, float]]]]  # (rt[, wait])


class HostedLoop:
    """A producer `Launch` whose loop runs in whichever thread calls `serve` (a long-running
    task). `end` asks a launched loop to stop; a launch after `end` raises `Stopped`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._run: Callable[[], None] | None = None
        self._stop: Callable[[], None] | None = None
        self._ended = False
        self._done = threading.Event()

    def launch(self, run: Callable[[], None], stop: Callable[[], None]) -> HostedLoop:
        with self._cond:
            if self._ended:
                raise Stopped("the run ended before its producer started")
            if self._run is not None:
                raise RuntimeError("HostedLoop hosts one loop")
            self._run, self._stop = run, stop
            self._cond.notify_all()
        return self

    def serve(self) -> None:
        """Runs the launched loop here once it is launched; returns at once if the run ends
        without one."""
        with self._cond:
            while self._run is None and not self._ended:
                self._cond.wait()
            run = self._run
        if run is None:
            return
        try:
            run()
        finally:
            self._done.set()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            stop = self._stop
            self._cond.notify_all()
        if stop is not None:
            stop()

    # LoopHandle
    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._run is not None and not self._done.is_set()


class RunLoops:
    def __init__(self, rt: RLRuntime, log: StepLog, phases: Phases):
        self.rt = rt
        self.log = log
        self.phases = phases
        self.host = HostedLoop()
        self.loops = ["train"]
        if rt.rollouts.ahead:
            rt.rollouts.launch = self.host.launch  # the producer's loop runs in `rollout`
            self.loops.insert(0, "rollout")
        if rt.rollouts.ahead and rt.overlaps_pushes:
            self.loops.append("weights")
        if rt.evaluation is not None and rt.evaluation.background:
            self.loops.append("evaluate")
        self.error: BaseException | None = None  # the first loop failure
        self._cond = threading.Condition()
        self._running = set(self.loops) - {"rollout"}  # rollout ends when these have
        self._to_push: collections.deque = collections.deque()
        self._pushed: collections.deque = collections.deque()
        self._to_eval: collections.deque = collections.deque()
        self._over = False

    def run(self, name: str) -> str:
        """Runs loop `name` to its end: "done", or "stopped" when another loop failed; raises
        (after stopping the others) if this one fails."""
        try:
            getattr(self, f"_{name}")()
            return "done"
        except Stopped:
            return "stopped"
        except BaseException as e:
            if self.error is not None:  # the run was ending: this is how the wait ended
                log.warning("loop %s stopped after the run failed: %r", name, e)
                return "stopped"
            self.fail(e)
            raise
        finally:
            self._ended(name)

    def fail(self, error: BaseException) -> None:
        """Ends the run: every waiting loop gets `Stopped`, the producer stops."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._over = True
            self._cond.notify_all()
        self.host.end()

    def _ended(self, name: str) -> None:
        with self._cond:
            self._running.discard(name)
            last = not self._running and not self._over
            if last:
                self._over = True
        if last:  # training and evaluation are done: the producer's loop may end
            self.host.end()

    # ------------------------------------------------------------------ hand-overs
    def _put(self, box: collections.deque, item: Any) -> None:
        with self._cond:
            box.append(item)
            self._cond.notify_all()

    def _get(self, box: collections.deque) -> Any:
        with self._cond:
            while True:
                if self.error is not None:
                    raise Stopped
                if box:
                    return box.popleft()
                if self._over:
                    raise Stopped
                self._cond.wait()

    def _check(self) -> None:
        if self.error is not None:
            raise Stopped

    # ------------------------------------------------------------------ the loops
    def _rollout(self) -> None:
        self.host.serve()
        if self.rt.producer is not None and self.error is None:
            self.rt.producer.raise_if_failed()

    def _train(self) -> None:
        rt, p = self.rt, self.phases
        steps = rt.config.train.num_steps
        overlap = "weights" in self.loops
        pending = None  # a step whose push overlaps this one: (step, t0, t_end, its metrics)
        try:
            if rt.start_step == 0 and rt.eval_due(0):  # a resumed run scored its start already
                self._evaluate_at(0, due=True, collect=False)
            for step in range(rt.start_step, steps):
                self._check()
                t0 = time.perf_counter()
                rollout = p.rollout(rt, step)
                train_metrics = p.train(rt, rollout)
                if not overlap:
                    self._finish(step, t0, 0.0, rollout.metrics, train_metrics, p.push(rt))
                    continue
                if pending is not None:  # pushed while this step trained
                    self._finish(*pending, self._get(self._pushed))
                self._put(self._to_push, rt.snapshot_weights())
                pending = (step, t0, time.perf_counter(), rollout.metrics, train_metrics)
                if rt.is_save_step(step) or rt.eval_due(step + 1) or step == steps - 1:
                    self._finish(*pending, self._get(self._pushed))  # the engines serve it
                    pending = None
            if rt.last_saved_step != steps - 1:
                p.save(rt, steps - 1)
            if "evaluate" not in self.loops and rt.evaluation is not None:
                self._finish_evaluations()
        finally:
            self._put(self._to_push, _END)
            if rt.evaluation is not None:
                self._put(self._to_eval, _END)

    def _finish(self, step: int, t0: float, t_end: float, *parts: dict[str, float]) -> None:
        """The rest of step `step` once its push is done: save, log, evaluate."""
        rt, p = self.rt, self.phases
        rollout_metrics, train_metrics, sync_metrics = parts
        phases = rollout_metrics | train_metrics | sync_metrics  # kept in the checkpoint
        saved = p.save(rt, step, phases) if rt.is_save_step(step) else {}
        self.log.step(step, t0, *parts, saved, t_end=t_end)
        if rt.evaluation is not None:  # the policy after step + 1 training steps
            self._evaluate_at(step + 1, due=rt.eval_due(step + 1), collect=True)

    def _evaluate_at(self, version: int, due: bool, collect: bool) -> None:
        if "evaluate" in self.loops:  # in the background: the trainer goes on
            self._put(self._to_eval, (version, due, collect))
        else:
            self._evaluation_item(version, due, collect)

    def _weights(self) -> None:
        while (snapshot := self._get(self._to_push)) is not _END:
            self._put(self._pushed, self.phases.push(self.rt, snapshot))

    def _evaluate(self) -> None:
        while (item := self._get(self._to_eval)) is not _END:
            self._evaluation_item(*item)
        self._check()
        self._finish_evaluations()

    def _evaluation_item(self, version: int, due: bool, collect: bool) -> None:
        if due:
            self.phases.evaluate(self.rt, version)
        if collect:
            for done, metrics in self.phases.collect(self.rt):
                self.log.evaluation(done, metrics)

    def _finish_evaluations(self) -> None:
        for done, metrics in self.phases.collect(self.rt, wait=True):  # the ones still pending
            self.log.evaluation(done, metrics)
