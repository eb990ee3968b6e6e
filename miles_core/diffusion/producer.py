"""An image run's rollouts: made when the trainer asks for a step (sync), or ahead of it by a
producer (one_step_off, fully_async) within the mode's staleness bound.

The producer makes each step's rollout in order, and the rollout of step k only once the
engine serves version k − max_staleness or later, so no trained image is more than
max_staleness versions old (the trainer trains step k at version k). Its loop runs wherever the
run launches it (`launch`: the flow's rollout task, else a daemon thread); a failure ends the
loop and the trainer's `take` re-raises it. A resumed run starts producing at its first step
again: nothing buffered survives a checkpoint, and no step is trained twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from miles_core.diffusion.rollout import ImageRollout
from miles_core.rollout.producer import ProducerStopped, start_thread


class ImageRollouts:
    def __init__(
        self,
        make: Callable[[int], ImageRollout],
        version: Callable[[], int],
        ahead: bool,
        max_staleness: int,
        steps: int,
    ):
        self.make = make
        self.version = version
        self.ahead = ahead
        self.max_staleness = max_staleness
        self.steps = steps
        self.launch = start_thread  # the loops replace it with their rollout task's
        self.producer: ImageRollouts | None = None  # self, once its loop is launched
        self._first = 0
        self._ready: dict[int, ImageRollout] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stopping = False
        self._handle = None

    def start_at(self, step: int) -> None:
        """The first step to make (a resumed run's)."""
        self._first = step

    def take(self, step: int) -> ImageRollout:
        """Step `step`'s rollout (made now, or waited for)."""
        if not self.ahead:
            return self.make(step)
        if self.producer is None:
            self.producer = self
            self._handle = self.launch(self._run, self._stop)
        with self._cond:
            while step not in self._ready:
                self.raise_if_failed()
                if self._stopping:
                    raise ProducerStopped("the image producer stopped")
                self._cond.wait()
            return self._ready.pop(step)

    def after_push(self) -> None:
        """A push changed the version: a producer waiting on it may go on."""
        with self._cond:
            self._cond.notify_all()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise ProducerStopped(f"the image producer failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            for step in range(self._first, self.steps):
                with self._cond:
                    while self.version() < step - self.max_staleness and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                rollout = self.make(step)
                with self._cond:
                    self._ready[step] = rollout
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 — handed to the trainer's take
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self) -> None:
        self._stop()
        if self._handle is not None:
            self._handle.join(timeout=60)
