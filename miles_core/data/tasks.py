"""Built-in tasks: a seeded prompt generator and a reward function each.

A task turns a label and the decoded completion into a reward in [0, 1] plus named per-sample
metrics (e.g. `exact_match`). Users register their own with `@TASKS.register(name)` or name one by
import path (`package.module:object`).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles_core.plugins import Registry


@dataclass
class Score:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Example:
    prompt: str | list[dict[str, Any]]  # a string, or chat messages
    label: Any
    answer: str | None = None  # a reference completion, used for SFT demonstrations
    adapter: str | None = None  # the LoRA adapter this prompt trains (a multi-LoRA run's data)
    # the data row's other fields (JSONL), kept on its samples (metadata "row"), e.g. the
    # teacher a distillation run scores it with
    fields: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str
    needs_label: bool  # score() compares against Example.label (JSONL rows must carry one)

    def generate(self, n: int, seed: int) -> list[Example]: ...

    def score(self, completion: str, label: Any) -> Score: ...


def _task(obj: Any, name: str) -> Task:
    """A registered or imported task: an object, or a class built without arguments."""
    return obj() if isinstance(obj, type) else obj


# the sandbox task sets (envs/tasks/: `terminal`, `terminal_basics`, ...) are imported when named
TASKS: Registry[Task] = Registry("task", "data.task", package="miles_core.envs.tasks", load=_task)


@TASKS.register("say_a")
class SayA:
    """Reward = fraction of the completion's characters that are the letter `a`."""

    name = "say_a"
    needs_label = False

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        words = ["say a", "a please", "write a", "letters", "go", "aaa?", "speak", "now"]
        return [Example(prompt=rng.choice(words), label=None, answer="a" * 8) for _ in range(n)]

    def score(self, completion: str, label: Any) -> Score:
        if not completion:
            return Score(0.0)
        return Score(completion.count("a") / len(completion))


@TASKS.register("reverse")
class Reverse:
    """Reverse a 4–8 letter string. Reward = per-position match; exact match is logged."""

    name = "reverse"
    needs_label = True

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
            out.append(Example(prompt=f"reverse {word}", label=word[::-1], answer=word[::-1]))
        return out

    def score(self, completion: str, label: Any) -> Score:
        target = str(label)
        got = completion.strip()
        width = max(len(target), len(got))
        matches = sum(1 for a, b in zip(got, target, strict=False) if a == b)
        exact = float(got == target)
        return Score(matches / width if width else 1.0, {"exact_match": exact})


@TASKS.register("add")
class Add:
    """Two- and three-digit addition; reward = exact match of the sum."""

    name = "add"
    needs_label = True

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a = rng.randint(10, 999)
            b = rng.randint(10, 999)
            out.append(Example(prompt=f"{a}+{b}=", label=a + b, answer=str(a + b)))
        return out

    def score(self, completion: str, label: Any) -> Score:
        exact = float(completion.strip() == str(label))
        return Score(exact, {"exact_match": exact})


@TASKS.register("mixture")
class Mixture:
    """Rows of several tasks in one dataset: a row's label is
    {"task": <a task's name>, "label": <that task's label>}, scored by that task (its metrics
    prefixed with its name). A multi-LoRA run trains one adapter per task this way (its rows,
    in data.path, name their adapters). Its generator draws the built-in `GENERATED` tasks in
    turn."""

    name = "mixture"
    needs_label = True
    GENERATED = ("say_a", "reverse", "add")

    def generate(self, n: int, seed: int) -> list[Example]:
        per_task = [
            TASKS.get(t).generate(-(-n // len(self.GENERATED)), seed) for t in self.GENERATED
        ]
        out = []
        for i in range(n):
            task, k = self.GENERATED[i % len(self.GENERATED)], i // len(self.GENERATED)
            ex = per_task[i % len(self.GENERATED)][k]
            out.append(
                Example(prompt=ex.prompt, label={"task": task, "label": ex.label}, answer=ex.answer)
            )
        return out

    def score(self, completion: str, label: Any) -> Score:
        if not isinstance(label, dict) or "task" not in label:
            raise ValueError('a mixture row\'s label is {"task": name, "label": ...}')
        task = TASKS.get(label["task"])
        inner = task.score(completion, label.get("label"))
        return Score(inner.reward, {f"{task.name}/{k}": v for k, v in inner.metrics.items()})
