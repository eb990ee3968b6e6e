"""Sandbox environments as a data task (`data.task`): examples whose prompt is the instruction
and whose label is the environment as a dict (with its "kind", for per-kind success). Rewards
come from the environment after the episode (the agent function), not from `score`.

    SandboxTasks(name, environment=MyEnv, make=make_my_env, kinds=("a", "b"),
                 eval_kinds=("a+b",), limits={"cpu_s": 5}, detours=("ls",))

`make(kind, rng)` builds one environment; `generate` draws the kinds in turn; `evaluation`
also draws `eval_kinds` (held out from training); `demonstration` is the SFT sample of an
example, rendered with the run's TITO family; `limits` are the task's sandbox limits
(`agent.sandbox` overrides them per field); `detours` are commands that change nothing, of
which a demonstration runs the first k before its script (k from 0 to all of them, fixed per
example): demonstrations that take more turns than needed, which RL can learn to skip where
`agent.turn_slack` leaves no room for them. Register an instance with
`miles_core.data.TASKS.register(name, tasks)`, or name it by import path in `data.task`.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from miles_core.data.tasks import Example, Score
from miles_core.envs.demonstration import demonstration
from miles_core.envs.environment import Environment, environment_path
from miles_core.envs.sandbox import SandboxLimits
from miles_core.tito import TitoFamily


class SandboxTasks:
    needs_label = True
    agentic = True  # rewards come from the environment, through the agent function

    def __init__(
        self,
        name: str,
        environment: type,
        make: Callable[[str, random.Random], Environment],
        kinds: Sequence[str],
        eval_kinds: Sequence[str] = (),
        limits: dict[str, Any] | None = None,
        detours: Sequence[str] = (),
    ):
        if not kinds:
            raise ValueError(f"task {name!r}: no kinds to draw")
        self.name = name
        self.environment = environment
        self.make = make
        self.kinds = tuple(kinds)
        self.eval_kinds = tuple(eval_kinds)
        self.limits = dict(limits or {})
        self.detours = tuple(detours)
        SandboxLimits(**self.limits)  # a wrong field name fails here, not in every episode

    @property
    def environment_path(self) -> str:
        return environment_path(self.environment)

    def _draw(self, n: int, seed: int, kinds: tuple[str, ...]) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            env = self.make(kinds[i % len(kinds)], rng)
            out.append(Example(prompt=env.instruction, label=env.to_dict()))
        return out

    def generate(self, n: int, seed: int) -> list[Example]:
        return self._draw(n, seed, self.kinds)

    def evaluation(self, n: int, seed: int) -> list[Example]:
        """Evaluation candidates: the training kinds and the held-out ones, in turn."""
        return self._draw(n, seed, self.kinds + self.eval_kinds)

    def score(self, completion: str, label) -> Score:
        raise ValueError(f"{self.name} tasks are scored by their environment (agent.function)")

    def environment_of(self, label: dict[str, Any]) -> Environment:
        return self.environment.from_dict(label)

    def demonstration(self, example: Example, family: TitoFamily) -> tuple[list[int], list[int]]:
        """(token ids, loss mask over the ids after the prompt) of the scripted episode, after
        the example's detours."""
        ids, mask, _ = demonstration(
            self.environment_of(example.label),
            family,
            SandboxLimits(**self.limits),
            self.detours[: self.detours_of(example)],
        )
        return ids, mask

    def detours_of(self, example: Example) -> int:
        """How many detours the example's demonstration takes: 0 to all, the same every time."""
        from miles_core.data.held_out import example_key

        return zlib.crc32(example_key(example).encode()) % (len(self.detours) + 1)
