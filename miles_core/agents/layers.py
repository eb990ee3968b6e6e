"""The three nested plug-in layers of agentic rollout, typed contracts, outermost first:

- rollout function: a class built with `RolloutSetup` (`RolloutFunction` below) — owns the
  data, grouping, rewards and everything else: a whole step (`__call__`, sync mode), one GRPO
  group of episodes (`group`, the async producer), evaluation episodes (`evaluate`);
- generate function: `async generate(GenerateInput) -> GenerateOutput` — one trajectory,
  including how its tokens are recorded (the default opens a session on the session server);
- agent function: `async run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None`
  — only the agent–environment loop; it speaks OpenAI chat to `base_url` and may return
  {"reward": …, "metrics": {…}} when the environment grades the episode itself.

The environment sets the reward (the agent function returns it), then the optional reward hooks
per episode and per group (`agents/rewards.py`); an episode left without one is FAILED. The
rollout function is wired in `rollout/sources.py: AgentSessions`; all three layers are chosen by
import path (`agent.rollout_function`, default `AgenticRollout`; `agent.generate_function`;
`agent.function`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.plugins import import_object
from miles_core.tito import Message
from miles_core.types import Sample, SampleGroup

if TYPE_CHECKING:
    from miles_core.agents.rewards import RewardHooks

AgentFn = Callable[[str, list[Message], dict[str, Any], dict[str, Any]], Awaitable[dict | None]]


@dataclass
class AgentResult:
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, value: dict | None) -> AgentResult:
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise TypeError(f"run_agent must return a dict or None, not {type(value).__name__}")
        reward = value.get("reward")
        return cls(None if reward is None else float(reward), dict(value.get("metrics") or {}))


@dataclass
class GenerateInput:
    prompt: list[Message]  # the task's opening messages
    metadata: dict[str, Any]  # the task (environment state the agent needs)
    request_kwargs: dict[str, Any]  # sampling: max_tokens, temperature, seed, ...
    rollout_id: str
    session_url: str  # the session server
    api_key: str | None = None  # the session server's key (Authorization: Bearer), if it has one
    routing_key: str | None = None  # episodes sharing one share an engine (default: by session)


@dataclass
class GenerateOutput:
    samples: list[Sample]  # one per trajectory leaf, sharing the rollout id
    reward: float | None = None  # the episode's reward (the environment's, then the hooks')
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the trajectory failed, if it did
    env_reward: float | None = None  # the environment's own grade, kept when hooks run


@dataclass
class RolloutSetup:
    config: Any  # RunConfig
    source: Any  # PromptSource: the run's prompts, in order (resumable)
    session_url: str
    generate: Callable[[GenerateInput], Awaitable[GenerateOutput]]
    rewards: RewardHooks | None = None  # None: the environment's reward as it is
    api_key: str | None = None  # the session server's key, handed to every GenerateInput
    metadata: dict[str, Any] = field(default_factory=dict)  # the run's, in every episode's


@dataclass
class RolloutInput:
    step: int
    weight_version: int


@dataclass
class RolloutOutput:
    groups: list[SampleGroup]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutFunction(Protocol):
    """The outer layer, built once per run with the `RolloutSetup`."""

    def __init__(self, setup: RolloutSetup) -> None: ...

    async def __call__(self, inp: RolloutInput) -> RolloutOutput:
        """One step's groups (sync mode)."""
        ...

    async def group(
        self,
        step: int,
        g: int,
        data_index: int,
        example: Any,
        limit: contextlib.AbstractAsyncContextManager,
    ) -> SampleGroup:
        """Group g of step `step` from one example, each episode under `limit` (the run's
        episodes in flight): what the async producer admits."""
        ...

    async def evaluate(self, examples: list) -> dict[str, float]:
        """eval/* metrics of one episode per example, nothing trained."""
        ...

    def session_counters(self) -> dict[str, float]:
        """The session server's per-step counters since the last call."""
        ...


DEFAULT_ROLLOUT_FUNCTION = "miles_core.agents.rollout:AgenticRollout"


def load_rollout_function(path: str | None, needs: tuple[str, ...]) -> type:
    """The rollout function class at `path` (default: AgenticRollout), checked to have the
    methods `needs` (what this run calls of it)."""
    path = path or DEFAULT_ROLLOUT_FUNCTION
    cls = import_object(path, "agent.rollout_function", example="package.module:Class")
    if not inspect.isclass(cls):
        raise PluginError(f"agent.rollout_function {path!r} must be a class (built with setup)")
    missing = [name for name in needs if not callable(getattr(cls, name, None))]
    if missing:
        raise PluginError(
            f"agent.rollout_function {path!r} has no {', '.join(missing)}, which this run "
            "calls (rollout.mode sync: __call__; one_step_off / fully_async: group; "
            "agent.eval_episodes: evaluate)"
        )
    return cls


class PluginError(ValueError):
    """An import path that does not name a usable plug-in."""


def load_plugin(path: str, what: str, want_async: bool = True) -> Any:
    """The object at "package.module:name", checked to be (an async) callable."""
    obj = import_object(path, what, example="package.module:name", error=PluginError)
    if not callable(obj) or (
        want_async and not inspect.isclass(obj) and not inspect.iscoroutinefunction(obj)
    ):
        raise PluginError(f"{what} {path!r} must be an async function")
    return obj
