"""Prompt datasets: JSONL files read through fsspec (local paths or s3://), or a task's generator."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import fsspec

from miles_core.data.tasks import TASKS, Example


class DatasetError(ValueError):
    pass


_KNOWN = frozenset({"prompt", "label", "answer", "adapter"})  # Example's own fields


def read_jsonl(url: str, storage_options: dict | None = None) -> list[Example]:
    """Rows need a `prompt` (string or chat messages); `label`, `answer` and `adapter` (the LoRA
    adapter the prompt trains, in a multi-LoRA run) are optional; any other field is kept as
    `Example.fields` (e.g. the teacher of a distillation run, `train.distill.teacher_key`)."""
    examples = []
    try:
        with fsspec.open(url, "rt", **(storage_options or {})) as f:
            lines = f.read().splitlines()
    except FileNotFoundError as e:
        raise DatasetError(f"dataset {url!r} not found") from e
    for row_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{url}: row {row_number} is not valid JSON ({e.msg})") from e
        if not isinstance(row, dict) or "prompt" not in row:
            raise DatasetError(f"{url}: row {row_number} has no 'prompt' field")
        prompt = row["prompt"]
        if (
            not isinstance(prompt, str | list)
            or not prompt
            or (isinstance(prompt, str) and not prompt.strip())
        ):
            raise DatasetError(
                f"{url}: row {row_number}: 'prompt' must be a non-empty string or message list"
            )
        if isinstance(prompt, list) and not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        ):
            raise DatasetError(
                f"{url}: row {row_number}: every message needs string 'role' and 'content'"
            )
        adapter = row.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise DatasetError(f"{url}: row {row_number}: 'adapter' must be an adapter's name")
        examples.append(
            Example(
                prompt=prompt,
                label=row.get("label"),
                answer=row.get("answer"),
                adapter=adapter,
                fields={k: v for k, v in row.items() if k not in _KNOWN},
            )
        )
    if not examples:
        raise DatasetError(f"dataset {url!r} has no rows")
    return examples


def load_examples(
    task: str, path: str | None, num_prompts: int, seed: int, storage_options: dict | None = None
) -> list[Example]:
    if path:
        return read_jsonl(path, storage_options)
    return TASKS.get(task).generate(num_prompts, seed)


def sft_examples(sft) -> list[Example]:
    """The examples of an `sft:` section (an `SFTConfig`): its file, or its task's draw."""
    return load_examples(sft.task, sft.path, sft.num_examples, sft.seed, sft.storage_options)


def rl_examples(config) -> list[Example]:
    """The RL prompts of a run (a `RunConfig`): `data.path`'s rows or `data.num_prompts` draws of
    `data.task`. With `data.exclude_sft`, none is an example of the SFT warm start: a file's
    matching rows are left out; a generator draws more (up to DRAWS_PER_EXAMPLE × as many) to
    keep `num_prompts`, and a ValueError says so when even that does not."""
    d = config.data
    rows = load_examples(d.task, d.path, d.num_prompts, d.seed, d.storage_options)
    if not d.exclude_sft:
        return rows
    from miles_core.data.held_out import DRAWS_PER_EXAMPLE, example_key

    sft = {example_key(ex) for ex in sft_examples(config.sft)}
    draws = d.num_prompts
    while True:
        kept = [ex for ex in rows if example_key(ex) not in sft]
        if d.path or len(kept) >= d.num_prompts:
            if not kept:
                raise DatasetError(f"data.exclude_sft: every row of {d.path!r} is an SFT example")
            return kept[: d.num_prompts]
        if draws >= d.num_prompts * DRAWS_PER_EXAMPLE:
            raise DatasetError(
                f"data.exclude_sft: {len(kept)} of {draws} prompts drawn from task {d.task!r} are "
                f"not SFT examples, {d.num_prompts} (data.num_prompts) were asked for: lower it "
                "or sft.num_examples, or give the task more variety"
            )
        draws *= 2
        rows = TASKS.get(d.task).generate(draws, d.seed)


def to_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


@dataclass
class PromptSource:
    """Serves prompts in epochs, shuffled per epoch by seed; `state()` resumes at the same prompt."""

    examples: list[Example]
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[tuple[int, Example]]:
        """The next n (dataset index, example) pairs, wrapping into new epochs."""
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._make_order()
            idx = self._order[self.offset]
            out.append((idx, self.examples[idx]))
            self.offset += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._make_order()
