"""A terminal-use environment: small file tasks an agent solves with one tool, "run a shell
command", inside its own sandbox; a checker scores the final workspace (1.0 solved, 0.0 not).

Kinds:
- `create`: create a file holding a word;
- `count`: count the lines of a file that contain a word, into answer.txt;
- `fix`: make a failing Python test pass by fixing the function it tests (which operator is
  wrong shows only in the code: the agent has to look, then edit).

Each task also carries a scripted solution (the commands that solve it), used for SFT warm-start
demonstrations and as a known-good agent in tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from miles_core.envs.sandbox import Sandbox

KINDS = ("create", "count", "fix")
_WORDS = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star"]
_FILES = ["a.txt", "b.txt", "notes.txt", "out.txt", "x.txt"]
_OPS = [("add", "+", "-"), ("mul", "*", "+"), ("sub", "-", "+")]
RUN_TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the workspace; returns its output",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    },
}


@dataclass
class TerminalTask:
    kind: str
    instruction: str
    files: dict[str, str] = field(default_factory=dict)
    solution: list[str] = field(default_factory=list)
    answer: str = ""  # what the checker expects (file content or number)
    target: str = ""  # the file the checker reads

    def setup(self, sandbox: Sandbox) -> None:
        for path, text in self.files.items():
            sandbox.write(path, text)

    def check(self, sandbox: Sandbox) -> float:
        """1.0 if the workspace solves the task, else 0.0 (never raises)."""
        try:
            if self.kind == "fix":  # the test as given, not as the agent may have left it
                sandbox.write("test_calc.py", self.files["test_calc.py"])
                return float(sandbox.run("python3 test_calc.py").ok)
            got = sandbox.read(self.target)
        except (ValueError, OSError):  # e.g. the answer is a symlink out of the workspace
            return 0.0
        return float(got is not None and got.strip() == self.answer)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "instruction": self.instruction,
            "files": self.files,
            "solution": self.solution,
            "answer": self.answer,
            "target": self.target,
        }

    @classmethod
    def from_dict(cls, data: dict) -> TerminalTask:
        return cls(**data)


def make_task(kind: str, rng: random.Random) -> TerminalTask:
    if kind == "create":
        name, word = rng.choice(_FILES), rng.choice(_WORDS)
        return TerminalTask(
            kind,
            f"create {name} with {word}",
            solution=[f"echo {word} > {name}"],
            answer=word,
            target=name,
        )
    if kind == "count":
        word, name = rng.choice(_WORDS), rng.choice(_FILES)
        lines = [f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}" for _ in range(rng.randint(3, 7))]
        count = sum(word in line.split() for line in lines)
        return TerminalTask(
            kind,
            f"count lines with {word} in {name}",
            files={name: "\n".join(lines) + "\n"},
            solution=[f"grep -cw {word} {name} > answer.txt"],
            answer=str(count),
            target="answer.txt",
        )
    if kind == "fix":
        name, good, bad = rng.choice(_OPS)
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        expected = {"add": a + b, "mul": a * b, "sub": a - b}[name]
        return TerminalTask(
            kind,
            "make test_calc.py pass",
            files={
                "calc.py": f"def {name}(a, b):\n    return a {bad} b\n",
                "test_calc.py": f"from calc import {name}\nassert {name}({a}, {b}) == {expected}\n",
            },
            # the instruction does not say which operator is wrong: read the code, then fix it
            solution=["cat calc.py", f"sed -i 's/a {bad} b/a {good} b/' calc.py"],
            target="calc.py",
        )
    raise ValueError(f"unknown terminal task kind {kind!r}; choose from {KINDS}")


def make_tasks(n: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[TerminalTask]:
    rng = random.Random(seed)
    return [make_task(kinds[i % len(kinds)], rng) for i in range(n)]
