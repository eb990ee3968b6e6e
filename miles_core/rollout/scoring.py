"""A task's reward function, called so that it cannot stop the run: under a timeout, with any
exception or non-finite reward turned into a failed sample (reward 0, nothing trained, the
reason kept in the sample's metadata and counted in `rollout/failed_samples`). A reward function
that asks the process to stop (`SystemExit`, `KeyboardInterrupt`) is obeyed: the run stops,
its servers with it."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from typing import Any

from miles_core.data.tasks import Score


class _Worker:
    """A daemon thread that runs calls handed to it, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="miles-reward", daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, box, done = job
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                box["error"] = e
            done.set()

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> dict[str, Any] | None:
        """The call's {"value"} or {"error"}, or None if it is still running after `timeout_s`:
        the worker is then abandoned and its thread ends when the call does."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if done.wait(timeout_s):
            return box
        self._jobs.put(None)
        return None


_idle: list[_Worker] = []  # workers between calls: a thread start per call cost ~0.1 ms
_idle_lock = threading.Lock()


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """`fn(*args)` on a daemon worker thread; TimeoutError if it runs past `timeout_s` (that
    worker is abandoned: a daemon, it never blocks the interpreter's exit, and later calls get
    another one)."""
    with _idle_lock:
        worker = _idle.pop() if _idle else _Worker()
    box = worker.call(fn, args, timeout_s)
    if box is None:
        raise TimeoutError(f"timed out after {timeout_s:g} s")
    with _idle_lock:
        _idle.append(worker)
    if "error" in box:
        raise box["error"]
    return box["value"]


def safe_score(task: Any, text: str, label: Any, timeout_s: float) -> tuple[Score, str | None]:
    """(the task's score, None), or (a zero score, why) when the reward function failed."""
    try:
        score = call_with_timeout(task.score, (text, label), timeout_s)
    except TimeoutError:
        return Score(0.0), f"reward function timed out after {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001  (the sample's failure, not the run's)
        return Score(0.0), f"reward function raised {e!r}"
    reward = getattr(score, "reward", None)
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return Score(0.0), f"reward function returned {score!r:.100}, not a Score with a number"
    if not math.isfinite(reward):
        return Score(0.0), f"reward function returned a non-finite reward ({reward})"
    return score, None
