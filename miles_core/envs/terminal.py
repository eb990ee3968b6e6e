"""A terminal-use environment (`environment.py`): file and code tasks an agent solves with one
tool, "run a shell command", inside its own sandbox; the checker scores the final workspace
(1.0 solved, 0.0 not).

Single tasks, by difficulty level (the commands a scripted solution needs):
- `create` (level 1): create a file holding a word;
- `count` (level 1): count the lines of a file that contain a word, into answer.txt;
- `fix` (level 2): make a failing test pass; which operator is wrong shows only in the code:
  look, then edit;
- `debug` (level 3): a module of three functions and a test of all three; which one fails
  shows only when the test runs, and where only in the code: run the test, find the line,
  fix it.

Compositions do two tasks in one episode ("A, then B"; both checked; their levels add up).
`TRAIN_KINDS` are what training draws; `HELD_OUT_KINDS` compositions (of parts training does
see) are drawn only for evaluation, so it measures more than memorised task shapes.
`SINGLE_KINDS` are what the SFT demonstrations cover (`terminal_basics`): RL has to learn to
carry on past the first part of a composition. Every task carries its scripted solution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from miles_core.envs.sandbox import Sandbox

SINGLE_KINDS = ("create", "count", "fix", "debug")
TRAIN_KINDS = (*SINGLE_KINDS, "create-count", "fix-count")
HELD_OUT_KINDS = ("create-fix",)
KINDS = TRAIN_KINDS + HELD_OUT_KINDS
# enough variety that evaluation finds every kind outside the SFT and RL draws (held_out.py)
_WORDS = (
    "red blue green cat dog cow sun moon star tree leaf root fish bird frog "
    "rain snow wind gold iron salt milk tea jam box cup pen map key cake lamp ship"
).split()
_FILES = ["a.txt", "b.txt", "c.txt", "notes.txt", "out.txt", "x.txt", "log.txt", "list.txt"]
_OPS = {"add": ("+", "-"), "mul": ("*", "+"), "sub": ("-", "+")}  # name: (right, wrong)
_APPLY = {"+": lambda a, b: a + b, "*": lambda a, b: a * b, "-": lambda a, b: a - b}
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
    """checks: all must hold — {"file": path, "equals": text} (the file's stripped content) or
    {"test": path} (the test as the task gave it, restored first, must exit 0)."""

    kind: str
    instruction: str
    files: dict[str, str] = field(default_factory=dict)
    solution: list[str] = field(default_factory=list)
    checks: list[dict[str, str]] = field(default_factory=list)
    level: int = 1

    def setup(self, sandbox: Sandbox) -> None:
        for path, text in self.files.items():
            sandbox.write(path, text)

    def check(self, sandbox: Sandbox) -> float:
        """1.0 if the workspace solves the task, else 0.0 (never raises)."""
        try:
            return float(all(self._holds(c, sandbox) for c in self.checks))
        except (ValueError, OSError):  # e.g. the answer is a symlink out of the workspace
            return 0.0

    def _holds(self, check: dict[str, str], sandbox: Sandbox) -> bool:
        if "test" in check:  # the test as given, not as the agent may have left it
            sandbox.write(check["test"], self.files[check["test"]])
            return sandbox.run(f"python3 {check['test']}").ok
        got = sandbox.read(check["file"])
        return got is not None and got.strip() == check["equals"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "level": self.level,
            "instruction": self.instruction,
            "files": self.files,
            "solution": self.solution,
            "checks": self.checks,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TerminalTask:
        return cls(**data)


def _create(rng: random.Random, taken: set[str]) -> TerminalTask:
    name, word = rng.choice([f for f in _FILES if f not in taken]), rng.choice(_WORDS)
    return TerminalTask(
        "create",
        f"create {name} with {word}",
        solution=[f"echo {word} > {name}"],
        checks=[{"file": name, "equals": word}],
    )


def _count(rng: random.Random, taken: set[str]) -> TerminalTask:
    word, name = rng.choice(_WORDS), rng.choice([f for f in _FILES if f not in taken])
    pool = [word, *rng.sample(_WORDS, 3)]  # the word shows up on some lines, not most
    lines = [f"{rng.choice(pool)} {rng.choice(pool)}" for _ in range(rng.randint(3, 7))]
    count = sum(word in line.split() for line in lines)
    return TerminalTask(
        "count",
        f"count lines with {word} in {name}",
        files={name: "\n".join(lines) + "\n"},
        solution=[f"grep -cw {word} {name} > answer.txt"],
        checks=[{"file": "answer.txt", "equals": str(count)}],
    )


def _fix(rng: random.Random, taken: set[str]) -> TerminalTask:
    name = rng.choice(sorted(_OPS))
    good, bad = _OPS[name]
    a, b = rng.randint(2, 19), rng.randint(2, 19)
    return TerminalTask(
        "fix",
        "make test_calc.py pass",
        files={
            "calc.py": f"def {name}(a, b):\n    return a {bad} b\n",
            "test_calc.py": f"from calc import {name}\n"
            f"assert {name}({a}, {b}) == {_APPLY[good](a, b)}\n",
        },
        # the instruction does not say which operator is wrong: read the code, then fix it
        solution=["cat calc.py", f"sed -i 's/a {bad} b/a {good} b/' calc.py"],
        checks=[{"test": "test_calc.py"}],
        level=2,
    )


def _debug(rng: random.Random, taken: set[str]) -> TerminalTask:
    names = rng.sample(sorted(_OPS), 3)
    broken = rng.choice(names)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    lines = [
        f"def {n}(a, b): return a {_OPS[n][1] if n == broken else _OPS[n][0]} b" for n in names
    ]
    cases = ", ".join(f"({n!r}, {n}, {_APPLY[_OPS[n][0]](a, b)})" for n in names)
    test = (
        f"from ops import {', '.join(names)}\n"
        f"for name, f, want in [{cases}]:\n"
        f"    if f({a}, {b}) != want:\n"
        f"        raise SystemExit(f'FAIL {{name}}({a}, {b}) = {{f({a}, {b})}}, want {{want}}')\n"
        "print('ok')\n"
    )
    line = names.index(broken) + 1
    good, bad = _OPS[broken]
    return TerminalTask(
        "debug",
        "make test_ops.py pass",
        files={"ops.py": "\n".join(lines) + "\n", "test_ops.py": test},
        # which function fails shows when the test runs; where it is, in the code
        solution=[
            "python3 test_ops.py",
            f"grep -n {broken} ops.py",
            f"sed -i '{line}s/{bad}/{good}/' ops.py",
        ],
        checks=[{"test": "test_ops.py"}],
        level=3,
    )


_PARTS = {"create": _create, "count": _count, "fix": _fix, "debug": _debug}


def make_task(kind: str, rng: random.Random) -> TerminalTask:
    """A task of `kind`: a single kind, or parts joined by "-" (done in that order)."""
    if kind not in KINDS:
        raise ValueError(f"unknown terminal task kind {kind!r}; choose from {', '.join(KINDS)}")
    tasks: list[TerminalTask] = []
    taken: set[str] = set()
    for part in kind.split("-"):
        task = _PARTS[part](rng, taken)
        taken |= set(task.files) | {c["file"] for c in task.checks if "file" in c}
        tasks.append(task)
    if len(tasks) == 1:
        return tasks[0]
    return TerminalTask(
        kind,
        ", then ".join(t.instruction for t in tasks),
        files={k: v for t in tasks for k, v in t.files.items()},
        solution=[cmd for t in tasks for cmd in t.solution],
        checks=[c for t in tasks for c in t.checks],
        level=sum(t.level for t in tasks),
    )


def make_tasks(n: int, seed: int, kinds: tuple[str, ...] = TRAIN_KINDS) -> list[TerminalTask]:
    rng = random.Random(seed)
    return [make_task(kinds[i % len(kinds)], rng) for i in range(n)]
