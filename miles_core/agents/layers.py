"""The three nested plug-in layers of agentic rollout, typed contracts, outermost first:

- rollout function: `async __call__(RolloutInput) -> RolloutOutput` — owns the data, grouping,
  rewards and everything else for one step (class, built with `RolloutSetup`);
- generate function: `async generate(GenerateInput) -> GenerateOutput` — one trajectory,
  including how its tokens are recorded (the default opens a session on the session server);
- agent function: `async run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None`
  — only the agent–environment loop; it speaks OpenAI chat to `base_url` and may return
  {"reward": …, "metrics": {…}} when the environment grades the episode itself.

The environment sets the reward (the agent function returns it), then the optional reward hooks
per episode and per group (`agents/rewards.py`); an episode left without one is FAILED. The
rollout function is wired in `rollout_source.AgenticRollouts` (`AgenticRollout`); generate and
agent functions are chosen by import path (`agent.generate_function`, `agent.function`).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.registry import import_object
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


@dataclass
class RolloutInput:
    step: int
    weight_version: int


@dataclass
class RolloutOutput:
    groups: list[SampleGroup]
    metrics: dict[str, float] = field(default_factory=dict)


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
