"""Evaluation examples that training never sees: drawn from the task's generator at the
evaluation seed (its `evaluation(n, seed)` where it has one: e.g. task kinds held out of
training), keeping only examples that are in no training row (by prompt and label: the RL
prompts and the SFT warm start's examples, `trained_on`) and not already kept. A task whose
generator cannot produce enough of them is refused before the run starts (preflight), naming
how many it found."""

from __future__ import annotations

import json
from collections.abc import Iterable

from miles_core.data.tasks import Example

DRAWS_PER_EXAMPLE = 20  # candidates drawn per evaluation example wanted
EVAL_SEED_OFFSET = 1_000_003  # agent.eval_episodes draws at data.seed + this


def example_key(ex: Example) -> str:
    """What makes two examples the same task: their prompt and label."""
    return json.dumps([ex.prompt, ex.label], sort_keys=True, default=repr)


def trained_on(config, rows: list[Example]) -> list[Example]:
    """Every example the run trains on: the RL `rows` and, with an SFT warm start, its examples
    (an evaluation task the SFT model memorised would measure memory, not skill)."""
    sft = config.sft
    if sft is None:
        return list(rows)
    from miles_core.data import sft_examples

    return [*rows, *sft_examples(sft)]


def held_out(task, n: int, seed: int, training: Iterable[Example], what: str) -> list[Example]:
    """`n` distinct examples of `task.generate(·, seed)` that are not in `training`, in the
    generator's order (the same list every time for the same inputs). Raises ValueError naming
    `what` (the setting that asked for them) when the generator's first n × DRAWS_PER_EXAMPLE
    draws hold fewer."""
    seen = {example_key(ex) for ex in training}
    out: list[Example] = []
    kept: set[str] = set()
    draws = n * DRAWS_PER_EXAMPLE
    draw = getattr(task, "evaluation", task.generate)  # a task may hold kinds out for it
    for ex in draw(draws, seed):
        key = example_key(ex)
        if key in seen or key in kept:
            continue
        kept.add(key)
        out.append(ex)
        if len(out) == n:
            return out
    raise ValueError(
        f"{what}: {n} evaluation tasks disjoint from the training set were asked for, but "
        f"{len(out)} of {draws} drawn from task {getattr(task, 'name', task)!r} are not "
        "training tasks or repeats: lower it, draw fewer training prompts (data.num_prompts), "
        "or give the task more variety"
    )
