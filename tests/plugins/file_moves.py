"""A task family of a user's own, built only on the environment protocol (what a new user
writes): files in the workspace, a checker, scripted solutions. Nothing of the terminal suite."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from miles_core.envs.sandbox_tasks import SandboxTasks

_NAMES = ["draft", "report", "todo", "log"]


@dataclass
class FileMove:
    kind: str
    instruction: str
    source: str
    target: str
    text: str
    solution: list[str] = field(default_factory=list)

    def setup(self, sandbox) -> None:
        sandbox.write(self.source, self.text)

    def check(self, sandbox) -> float:
        try:
            moved = sandbox.read(self.target) == self.text
            gone = self.kind != "move" or sandbox.read(self.source) is None
        except (ValueError, OSError):
            return 0.0
        return float(moved and gone)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "instruction": self.instruction,
            "source": self.source,
            "target": self.target,
            "text": self.text,
            "solution": self.solution,
        }

    @classmethod
    def from_dict(cls, data: dict) -> FileMove:
        return cls(**data)


def make(kind: str, rng: random.Random) -> FileMove:
    a, b = rng.sample(_NAMES, 2)
    verb, cmd = {"move": ("move", "mv"), "copy": ("copy", "cp")}[kind]
    return FileMove(
        kind,
        f"{verb} {a}.txt to {b}.txt",
        f"{a}.txt",
        f"{b}.txt",
        f"{rng.randint(0, 999)}\n",
        solution=[f"{cmd} {a}.txt {b}.txt"],
    )


TASKS = SandboxTasks("file_moves", FileMove, make, kinds=("move",), eval_kinds=("copy",),
                     limits={"cpu_s": 2})  # fmt: skip
