"""Where a run's rollouts come from: a `RolloutSource`, one class per way of producing them:

    SyncRollouts     rollout.mode sync: each step generates its groups on the engine, then trains
    AsyncRollouts    one_step_off / fully_async: a `RolloutProducer` keeps the engine server busy
                     (started on the first rollout, after a resume has set the data position; a
                     resumed checkpoint's buffered groups are handed to it then)
    AgenticRollouts  agent.function: agent episodes through a session server in front of the
                     engine server (agents/rollout.py)

Each also scores the policy its engine serves now for a shared-mode evaluation (`score`), says
what a checkpoint keeps of it (`snapshot`, `data_state`) and takes it back (`restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from miles_core.data import PromptSource
from miles_core.engines.fleet import EngineFleet
from miles_core.eval.scoring import EvalSpec, score_policy
from miles_core.rollout.engine_groups import EngineGroups
from miles_core.rollout.group_source import GroupSource, HookedGroups
from miles_core.rollout.mode import MODES
from miles_core.rollout.producer import Launch, RolloutProducer, start_thread
from miles_core.rollout.rollout_fn import RolloutResult, generate_groups
from miles_core.token_fields import load_token_fields, token_field
from miles_core.types import SampleGroup


class RolloutSource:
    """What the run asks of its rollouts, whatever the mode: the step's groups (`take`), a
    shared-mode evaluation on the engine (`score`), holding admission while one runs, the push
    hooks, and what a checkpoint keeps of it (`snapshot`, `data_state`, `restore`)."""

    producer: RolloutProducer | None = None
    ahead = False  # whether a producer generates ahead of the trainer (the run gets a rollout loop)
    agent_rollout = None
    session_process = None

    def __init__(self, config, fleet: EngineFleet, tokenizer, task, prompts: PromptSource):
        self.config = config
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.task = task
        self.prompts = prompts
        # blocking calls each completed group passes through before the trainer gets it (e.g.
        # teachers scoring it): in async modes on the producer's side, as groups complete
        self.group_hooks: list[Callable[[SampleGroup], None]] = []

    def take(self, step: int) -> RolloutResult:
        raise NotImplementedError

    def _hooked(self, result: RolloutResult) -> RolloutResult:
        for g in result.groups:
            for hook in self.group_hooks:
                hook(g)
        return result

    def score(self) -> dict[str, float]:
        """eval/* metrics of the fixed eval prompts of data.task on the rollout engine."""
        return score_policy(self.fleet.engine, self.tokenizer, EvalSpec.from_run(self.config))

    def held(self) -> contextlib.AbstractContextManager:
        """While held, no new rollout work is admitted (an evaluation runs meanwhile)."""
        return contextlib.nullcontext()

    def before_push(self) -> None:
        """Called before a weight push."""

    def after_push(self) -> None:
        """Called once the engines serve the new version."""

    def snapshot(self) -> dict | None:
        """The buffered groups a checkpoint keeps (async modes), or None."""
        return None

    def data_state(self, snapshot: dict | None) -> dict:
        """The data position a checkpoint keeps: after every group taken or buffered."""
        return snapshot["source_state"] if snapshot else self.prompts.state()

    def restore(self, buffer: dict | None) -> None:
        """A resumed checkpoint's buffer (sync: there is none to restore)."""

    def close(self) -> None:
        pass


class SyncRollouts(RolloutSource):
    """Generate, then train: the step's prompts on the engine, one call."""

    def take(self, step: int) -> RolloutResult:
        r = self.config.rollout
        batch = self.prompts.next_batch(r.prompts_per_step)
        result = generate_groups(self.fleet.engine, self.tokenizer, self.task, batch, r, step)
        return self._hooked(result)


class AsyncRollouts(RolloutSource):
    """A producer generates ahead of the trainer; `engine_version` says what the engines serve."""

    ahead = True

    def __init__(self, config, fleet, tokenizer, task, prompts, engine_version: Callable[[], int]):
        super().__init__(config, fleet, tokenizer, task, prompts)
        self.engine_version = engine_version
        self.producer: RolloutProducer | None = None
        self.groups: GroupSource | None = None  # what a group is; None: a prompt's completions
        self._restored: dict | None = None  # a resumed checkpoint's buffer, for the producer
        # where the producer's loop runs: its own thread, or a flow's long-running task
        # (set before the first `take`: miles_core/run/loops.py)
        self.launch: Launch = start_thread

    def take(self, step: int) -> RolloutResult:
        if self.producer is None:  # first call: after a resume has set the data position
            r = self.config.rollout
            groups = self.groups or EngineGroups(self.fleet.engine, self.tokenizer, self.task, r)
            if self.group_hooks:
                groups = HookedGroups(groups, self.group_hooks)
            self.producer = RolloutProducer(
                self.fleet.engine,
                self.tokenizer,
                self.task,
                self.prompts,
                r,
                version=self.engine_version,
                first_group=step * r.prompts_per_step,
                launch=self.launch,
                groups=groups,
            )
            if self._restored is not None:  # groups buffered at the resumed checkpoint
                self.producer.restore(self._restored)
                self._restored = None
            self.producer.start()
        return self.producer.take(step)

    def held(self) -> contextlib.AbstractContextManager:
        return self.producer.held() if self.producer else contextlib.nullcontext()

    def before_push(self) -> None:
        if self.producer is not None and MODES.get(self.config.rollout.mode).drains_before_push:
            self.producer.wait_idle()  # the batch in flight finishes on the old weights

    def after_push(self) -> None:
        if self.producer is not None:
            self.producer.notify_version()

    def snapshot(self) -> dict | None:
        return self.producer.snapshot() if self.producer else None

    def restore(self, buffer: dict | None) -> None:
        self._restored = buffer

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()


class AgentSessions:
    """What an agentic run adds in front of the engine server: the session server (token-faithful
    records of every model call) and the agentic rollout function built on it."""

    def __init__(self, config, fleet, tokenizer, task, prompts, workdir: Path):
        from miles_core.agents.layers import RolloutSetup, load_rollout_function
        from miles_core.sessions import SessionServerProcess
        from miles_core.tito.check import check_family_matches

        agent = config.agent
        assert fleet.servers, "the config requires an engine server"
        check_family_matches(agent.family, tokenizer)
        self.config = config
        self.prompts = prompts
        self._eval_examples: list | None = None  # drawn on the first evaluation
        needs = ("group",) if MODES.get(config.rollout.mode).ahead else ("__call__",)
        rollout_cls = load_rollout_function(
            agent.rollout_function, needs + (("evaluate",) if agent.eval_episodes else ())
        )
        budget = agent.max_session_tokens
        adapter = config.rollout.adapter  # train.lora: every turn names the run's adapter
        self.process = SessionServerProcess(
            fleet.url,  # the router over several engine servers: sessions stick to one
            agent.family,
            log_path=workdir / "sessions.log",
            args=(
                "--max-tokens",
                str(agent.max_tokens),
                *(() if budget is None else ("--token-budget", str(budget))),
                *_token_field_args(config),
                *(() if adapter is None else ("--lora-path", adapter)),
            ),
            port_range=config.network.ports,
            api_key=fleet.api_key,  # the run's key: its engine requires it too
        ).start()
        try:
            generate, hooks = _agent_plugins(agent)
            setup = RolloutSetup(
                config,
                prompts,
                self.process.url,
                generate,
                hooks,
                fleet.api_key,
                metadata=episode_metadata(config, task),
            )
            self.rollout = rollout_cls(setup)
        except BaseException:
            self.process.stop()
            raise

    def score(self, task) -> dict[str, float]:
        """eval/* metrics of agent episodes on fixed tasks (agent.eval_episodes), none of them a
        training task (`data/held_out.py`)."""
        from miles_core.data.held_out import EVAL_SEED_OFFSET, held_out, trained_on

        c = self.config
        if self._eval_examples is None:
            self._eval_examples = held_out(
                task,
                c.agent.eval_episodes,
                c.data.seed + EVAL_SEED_OFFSET,
                trained_on(c, self.prompts.examples),
                "agent.eval_episodes",
            )
        return asyncio.run(self.rollout.evaluate(self._eval_examples))

    def close(self) -> None:
        self.process.stop()


class AgenticRollouts(RolloutSource):
    """Agent episodes recorded by a session server in front of the engine server, a step's
    groups at a time (sync mode)."""

    def __init__(self, config, fleet, tokenizer, task, prompts, engine_version, workdir: Path):
        super().__init__(config, fleet, tokenizer, task, prompts)
        self.engine_version = engine_version
        self.agents = AgentSessions(config, fleet, tokenizer, task, prompts, workdir)
        self.session_process, self.agent_rollout = self.agents.process, self.agents.rollout

    def take(self, step: int) -> RolloutResult:
        from miles_core.agents.layers import RolloutInput

        out = asyncio.run(self.agent_rollout(RolloutInput(step, self.engine_version())))
        return self._hooked(RolloutResult(out.groups, out.metrics))

    def score(self) -> dict[str, float]:
        return self.agents.score(self.task)

    def close(self) -> None:
        self.agents.close()


class AsyncAgenticRollouts(AsyncRollouts):
    """Agent episodes generated ahead of the trainer (one_step_off / fully_async): the producer
    admits groups of episodes under the staleness policy (`agents/episode_groups.py`)."""

    def __init__(self, config, fleet, tokenizer, task, prompts, engine_version, workdir: Path):
        from miles_core.agents.episode_groups import EpisodeGroups

        super().__init__(config, fleet, tokenizer, task, prompts, engine_version)
        self.agents = AgentSessions(config, fleet, tokenizer, task, prompts, workdir)
        self.session_process, self.agent_rollout = self.agents.process, self.agents.rollout
        self.groups = EpisodeGroups(self.agent_rollout)

    def score(self) -> dict[str, float]:
        return self.agents.score(self.task)

    def close(self) -> None:
        try:
            super().close()  # the producer first: its episodes use the session server
        finally:
            self.agents.close()


def episode_metadata(config, task) -> dict:
    """What every episode's agent is handed besides its task: for a sandbox environment task
    (`envs/sandbox_tasks.py`), the environment's import path and its sandbox limits (the
    task's, overridden per field by agent.sandbox), and agent.turn_slack where set."""
    path = getattr(task, "environment_path", None)
    if path is None:
        return {}
    slack = config.agent.turn_slack
    return {
        "environment": path,
        "limits": dict(getattr(task, "limits", {})) | config.agent.sandbox.overrides(),
    } | ({"turn_slack": slack} if slack is not None else {})


def _agent_plugins(agent):
    """The generate function and the reward hooks of the agent section (import paths)."""
    from miles_core.agents.layers import load_plugin
    from miles_core.agents.session_generate import make_session_generate

    if agent.generate_function:
        generate = load_plugin(agent.generate_function, "agent.generate_function")
    else:
        run_agent = load_plugin(agent.function, "agent.function")
        generate = make_session_generate(run_agent, agent.timeout_s)
    hooks = None
    if agent.reward_function or agent.group_reward_function:
        from miles_core.agents.rewards import RewardHooks

        def hook(path: str | None, what: str):
            return load_plugin(path, what, want_async=False) if path else None

        hooks = RewardHooks(
            hook(agent.reward_function, "agent.reward_function"),
            hook(agent.group_reward_function, "agent.group_reward_function"),
            agent.reward_timeout_s,
        )
    return generate, hooks


def make_rollouts(
    config,
    fleet: EngineFleet,
    tokenizer,
    task,
    prompts: PromptSource,
    engine_version: Callable[[], int],
    workdir: Path,
) -> RolloutSource:
    """The rollout source of the config: agentic or not, sync or async."""
    ahead = MODES.get(config.rollout.mode).ahead
    if config.agent.function is not None:
        agentic = AsyncAgenticRollouts if ahead else AgenticRollouts
        return agentic(config, fleet, tokenizer, task, prompts, engine_version, workdir)
    if not ahead:
        return SyncRollouts(config, fleet, tokenizer, task, prompts)
    return AsyncRollouts(config, fleet, tokenizer, task, prompts, engine_version)


def _token_field_args(config) -> tuple[str, ...]:
    """The session server's `--token-field-json` for each of the run's token fields, as this
    process declared them for the model (`token_fields.declare_for_model`)."""
    names = [load_token_fields([p])[0].name for p in config.rollout.token_fields]
    return tuple(
        arg
        for name in names
        for arg in ("--token-field-json", json.dumps(token_field(name).declaration()))
    )
