"""Reward hooks of agentic rollout: who sets an episode's reward, and what happens when that fails.

Three sources, applied in this order (each later one sees what the earlier ones set):

1. the environment: the agent function returns {"reward": …} (e.g. the terminal checker);
2. `agent.reward_function` ("pkg.mod:name"), per episode: `reward(episode: Episode) -> float`;
3. `agent.group_reward_function`, per group (the n episodes of one prompt):
   `reward(episodes: list[Episode]) -> list[float]` — e.g. ranking or comparing attempts. It
   sees the whole group, episodes that already failed included (`error` set, `reward` maybe
   None); what it returns for those is ignored: they stay failed.

Hooks may be plain or async functions. Every call runs under `agent.reward_timeout_s`; a hook
that raises, times out, or returns anything but a finite number (or, per group, a list of n of
them) fails the episodes it was scoring, with the reason: they stay in the batch, masked, and
training goes on. Plain functions run on daemon threads: one that never returns is abandoned at
the timeout (its thread leaks, the run does not wait for it). A hook that asks the process to
stop (`SystemExit`, `KeyboardInterrupt`) is obeyed, as a task's reward function is
(rollout/scoring.py): the run stops.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_core.agents.layers import GenerateOutput
from miles_core.types import Sample


@dataclass
class Episode:
    """What a reward hook sees of one episode."""

    samples: list[Sample]  # one per trajectory leaf (token ids, masks, log-probs)
    task: Any  # the example's label (for terminal tasks: the task as a dict)
    env_reward: float | None  # what the environment set, if anything
    metrics: dict[str, float] = field(default_factory=dict)  # the agent's own metrics
    reward: float | None = None  # the reward so far (env, then the per-episode hook)
    error: str | None = None  # set when the episode already failed: it trains nothing, and
    # its reward may be None; a group hook still sees it (rank it last, or ignore it)


class RewardHookError(RuntimeError):
    pass


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardHookError(f"{what} returned {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise RewardHookError(f"{what} returned a non-finite reward ({value})")
    return float(value)


def _in_daemon_thread(fn: Callable, arg: Any) -> asyncio.Future:
    """`fn(arg)` on a daemon thread of its own: unlike the loop's default executor, a call that
    never returns does not block the loop's shutdown (or the interpreter's exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def work() -> None:
        try:
            value, error = fn(arg), None
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=work, name="miles-reward-hook", daemon=True).start()
    return future


async def call_hook(fn: Callable, arg: Any, timeout_s: float, what: str) -> Any:
    """`fn(arg)` (plain or async; an object whose call returns an awaitable counts as async)
    under a timeout; any failure as a RewardHookError."""
    t0 = time.monotonic()

    async def call() -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(arg)
        value = await _in_daemon_thread(fn, arg)
        return await value if inspect.isawaitable(value) else value

    try:
        return await asyncio.wait_for(call(), timeout_s)
    except TimeoutError as e:
        if time.monotonic() - t0 >= timeout_s:
            raise RewardHookError(f"{what} timed out after {timeout_s:g} s") from None
        raise RewardHookError(f"{what} raised {e!r}") from e  # the hook's own timeout
    except Exception as e:  # noqa: BLE001  (the hook's failure fails its episodes, not the step)
        raise RewardHookError(f"{what} raised {e!r}") from e


@dataclass
class RewardHooks:
    per_episode: Callable | None = None
    per_group: Callable | None = None
    timeout_s: float = 30.0

    async def apply(self, outputs: list[GenerateOutput], tasks: list[Any], n: int) -> int:
        """Sets each output's final reward in place (groups of `n` consecutive outputs); an
        output a hook fails gets `error`. Returns how many episodes a hook failed."""
        episodes = [
            Episode(o.samples, task, o.reward, dict(o.metrics), o.reward, o.error)
            for o, task in zip(outputs, tasks, strict=True)
        ]
        for o in outputs:
            o.env_reward = o.reward
        failed = 0
        if self.per_episode is not None:
            results = await asyncio.gather(
                *(self._one(e) for e, o in zip(episodes, outputs, strict=True) if o.error is None)
            )
            live = [i for i, o in enumerate(outputs) if o.error is None]
            for i, (reward, error) in zip(live, results, strict=True):
                episodes[i].reward = reward
                if error is not None:
                    outputs[i].error, failed = error, failed + 1
                    episodes[i].error = error
        if self.per_group is not None:
            groups = [list(range(g, g + n)) for g in range(0, len(outputs), n)]
            results = await asyncio.gather(*(self._group([episodes[i] for i in g]) for g in groups))
            for members, (rewards, error) in zip(groups, results, strict=True):
                for i, reward in zip(members, rewards, strict=True):
                    episodes[i].reward = reward
                    if error is not None and outputs[i].error is None:
                        outputs[i].error, failed = error, failed + 1
        for o, e in zip(outputs, episodes, strict=True):
            o.reward = e.reward
        return failed

    async def _one(self, episode: Episode) -> tuple[float | None, str | None]:
        what = "agent.reward_function"
        try:
            value = await call_hook(self.per_episode, episode, self.timeout_s, what)
            return _finite(value, what), None
        except RewardHookError as e:
            return None, str(e)

    async def _group(self, episodes: list[Episode]) -> tuple[list[float | None], str | None]:
        what = "agent.group_reward_function"
        try:
            values = await call_hook(self.per_group, episodes, self.timeout_s, what)
            if not isinstance(values, list | tuple) or len(values) != len(episodes):
                raise RewardHookError(f"{what} must return a list of {len(episodes)} rewards")
            return [_finite(v, what) for v in values], None
        except RewardHookError as e:
            return [None] * len(episodes), str(e)
