"""A task's reward function, called so that it cannot stop the run: under a timeout, with any
exception or non-finite reward turned into a failed sample (reward 0, nothing trained, the
reason kept in the sample's metadata and counted in `rollout/failed_samples`). A reward function
that asks the process to stop (`SystemExit`, `KeyboardInterrupt`) is obeyed: the run stops,
its servers with it."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from miles_core.data.tasks import Score


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """`fn(*args)` on a daemon thread; TimeoutError if it runs past `timeout_s` (the thread is
    abandoned: a daemon, it never blocks the interpreter's exit)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = e

    thread = threading.Thread(target=work, name="miles-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"timed out after {timeout_s:g} s")
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
