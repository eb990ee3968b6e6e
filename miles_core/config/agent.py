"""The `agent:` section: agentic rollout (episodes recorded by the session server)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_core.config.base import Strict

RUN_COMMAND = "miles_core.agents.blackbox:run_command"  # the agent function of agent.command


class SandboxConfig(Strict):
    """Per-command sandbox limits of a sandbox environment's episodes (`envs/sandbox.py`);
    unset fields keep the task's own (SandboxTasks limits), else the sandbox's defaults."""

    cpu_s: int | None = Field(None, gt=0, description="CPU seconds per command")
    wall_s: float | None = Field(None, gt=0, description="wall-clock seconds per command")
    memory_mb: int | None = Field(None, gt=0, description="address space per command (MiB)")
    processes: int | None = Field(None, gt=0, description="processes (enforced as root)")
    file_mb: int | None = Field(None, gt=0, description="largest file a command may write (MiB)")
    disk_mb: int | None = Field(
        None, gt=0, description="disk the whole workspace may hold (MiB; enforced per command)"
    )

    def overrides(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class AgentConfig(Strict):
    """Agentic rollout: every sample is an agent episode recorded by the session server."""

    function: str | None = Field(
        None,
        description="agent function 'package.module:name' (async run_agent(base_url, prompt, "
        "request_kwargs, metadata)); set → agentic rollout, e.g. "
        "miles_core.envs.sandbox_agent:run_agent",
    )
    generate_function: str | None = Field(
        None, description="replace the session-backed generate function (import path)"
    )
    command: list[str] | None = Field(
        None,
        description="a black-box agent program's argv (e.g. [python, examples/blackbox_harness/"
        "agent.py]), run per episode by agent.function miles_core.agents.blackbox:run_command",
    )
    family: str = Field(
        "tiny",
        description="TITO family of the session server: a registered name (tiny, qwen3, mistral, "
        "or a module added to miles_core/chat_templates/) or 'package.module:Class'",
    )
    rollout_function: str | None = Field(
        None,
        description="replace the outer agentic rollout function: 'package.module:Class', built "
        "with a RolloutSetup (agents/layers.py: RolloutFunction); default "
        "miles_core.agents.rollout:AgenticRollout",
    )
    max_turns: int = Field(4, gt=0, le=100, description="model calls per episode")
    turn_slack: int | None = Field(
        None,
        ge=0,
        description="a sandbox task's episode may make as many model calls as its scripted "
        "solution has tool calls, plus this many (at most agent.max_turns): 0 asks for a "
        "solution as direct as the script's. Default: agent.max_turns for every episode",
    )
    max_tokens: int = Field(
        96, gt=0, description="new tokens per model call (a tool call must fit: preflight checks)"
    )
    max_session_tokens: int | None = Field(
        None,
        gt=0,
        description="an episode's token budget: its conversation (prompt + every reply and tool "
        "result) at most this many ids; each call's new tokens are capped to what is left, and "
        "a call with nothing left ends the episode, graded (default: the model's context)",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="an episode running longer (wall clock) fails"
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    concurrency: int = Field(32, gt=0, description="episodes in flight")
    routing: Literal["group", "session"] = Field(
        "group",
        description="which episodes share an engine behind the router: `group`, every episode "
        "of a GRPO group (their common prompt is computed once and cached for the siblings); "
        "`session`, each episode by itself (spreads the load finer)",
    )
    reward_function: str | None = Field(
        None,
        description="per-episode reward hook 'pkg.mod:name' (episode: Episode) -> float, applied "
        "after the environment's reward (agents/rewards.py)",
    )
    group_reward_function: str | None = Field(
        None,
        description="per-group reward hook 'pkg.mod:name' (episodes: list[Episode]) -> "
        "list[float], applied last",
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="a reward hook call running longer fails its episodes"
    )
    eval_episodes: int = Field(
        0,
        ge=0,
        description="episodes on fixed evaluation tasks (one each, fixed seeds) before the first "
        "and after the last step, logged as eval/success_rate; 0 = no evaluation",
    )
    eval_every: int = Field(
        0, ge=0, description="also evaluate after every N steps (0 = first and last only)"
    )
    eval_samples: int = Field(
        1,
        ge=1,
        le=16,
        description="episodes per evaluation task, each at its own fixed seed (the first the one "
        "a 1-sample evaluation runs); eval/* average over all of them: k samples, a standard error "
        "about 1/sqrt(k) as wide",
    )

    @model_validator(mode="after")
    def _settings_fit(self) -> AgentConfig:
        if self.function is not None:
            if (self.function == RUN_COMMAND) != bool(self.command):
                raise ValueError(f"agent.command and agent.function: {RUN_COMMAND} go together")
            if self.eval_every and not self.eval_episodes:
                raise ValueError("agent.eval_every needs agent.eval_episodes > 0")
            if self.eval_samples > 1 and not self.eval_episodes:
                raise ValueError("agent.eval_samples needs agent.eval_episodes > 0")
            return self
        unused = [
            name
            for name, value in (
                ("agent.generate_function", self.generate_function),
                ("agent.rollout_function", self.rollout_function),
                ("agent.command", self.command),
                ("agent.reward_function", self.reward_function),
                ("agent.group_reward_function", self.group_reward_function),
                ("agent.eval_episodes", self.eval_episodes),
                ("agent.eval_samples", self.eval_samples > 1),
            )
            if value
        ]
        if unused:
            raise ValueError(f"{', '.join(unused)} needs agent.function (agentic rollout)")
        return self

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        from miles_core.tito import FAMILIES

        FAMILIES.get(v)  # ValueError naming the registered families; imports an import path
        return v
