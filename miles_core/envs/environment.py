"""The environment protocol: one task instance an agent solves with one tool, `run` (a shell
command in the episode's own sandbox), graded by a checker of the final workspace.

An environment is any class with

- `kind: str` — its task kind: success is reported per kind (`rollout/success_rate/<kind>`,
  `eval/success_rate/<kind>`), read from the example label's "kind";
- `instruction: str` — what the agent is asked (the episode's first user message);
- `solution: list[str]` — scripted commands that solve it (SFT demonstrations, tests);
- `setup(sandbox)` — put the task's files in a fresh workspace;
- `check(sandbox) -> float` — grade the workspace in [0, 1], never raising;
- `to_dict() -> dict` and `classmethod from_dict(dict)` — the task as an example's label (JSON).

A task family (`sandbox_tasks.SandboxTasks`) generates them; the tool-using agent loop
(`sandbox_agent.run_agent`) and the SFT demonstrations (`demonstration.py`) work for any of
them. The class travels to the agent as an import path chosen by the run's config (the data
task), never by an episode.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from miles_core.envs.sandbox import Sandbox
from miles_core.plugins import import_object


@runtime_checkable
class Environment(Protocol):
    kind: str
    instruction: str
    solution: list[str]

    def setup(self, sandbox: Sandbox) -> None: ...

    def check(self, sandbox: Sandbox) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment: ...


def environment_path(cls: type) -> str:
    """The import path `package.module:Class` that `load_environment` reads back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_environment(path: str) -> type[Environment]:
    """The environment class at `path`, checked to provide the protocol."""
    cls = import_object(path, "environment", example="package.module:Class")
    missing = [
        name
        for name in ("setup", "check", "to_dict", "from_dict")
        if not callable(getattr(cls, name, None))
    ]
    if not isinstance(cls, type) or missing:
        raise ValueError(
            f"environment {path!r} must be a class with setup, check, to_dict and from_dict"
            + (f" (missing: {', '.join(missing)})" if missing and isinstance(cls, type) else "")
        )
    return cls
