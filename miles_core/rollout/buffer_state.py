"""The async producer's buffer as JSON (`rollout_buffer.json` in a checkpoint).

`RolloutProducer.snapshot()` writes, under its lock, every group admitted and not yet taken by
the trainer: completed ones with their samples (tokens, log-probs, rewards, weight versions,
declared per-token fields as exact bytes), those still generating by identity (group index over
the run, dataset row, the prompt source's state before the row was drawn, admission version),
the retry queue, the admission counters and the prompt source's position after all of them.
`RolloutProducer.restore()` takes it back: completed groups are handed to the trainer as they
are, the others are generated again with their own sampling seeds, and new prompts continue
after the last admitted one.

A sample's prompt and label are not stored: they are the dataset row's (`data_index`), which the
restoring producer looks up, so a task's labels need not be JSON.
"""

from __future__ import annotations

from typing import Any

from miles_core.data.tasks import Example
from miles_core.types import SampleGroup, sample_from_json, sample_to_json

BUFFER_FILE = "rollout_buffer.json"
BUFFER_VERSION = 1  # samples may carry `token_fields` (absent in older buffers: none)
_FROM_ROW = ("prompt", "label")


def group_to_json(group: SampleGroup) -> dict[str, Any]:
    samples = [sample_to_json(s, skip=_FROM_ROW) for s in group.samples]
    return {"group_index": group.group_index, "samples": samples}


def group_from_json(data: dict[str, Any], example: Example) -> SampleGroup:
    samples = []
    for raw in data["samples"]:
        sample = sample_from_json(raw, prompt=example.prompt, label=example.label)
        sample.validate()
        samples.append(sample)
    return SampleGroup(group_index=int(data["group_index"]), samples=samples)


def check_buffer(
    data: dict[str, Any], prompts_per_step: int, n_samples: int, stale_policy: str | None = None
) -> None:
    """Refuses a buffer this producer cannot continue, naming what differs."""
    if data.get("version") != BUFFER_VERSION:
        raise ValueError(
            f"{BUFFER_FILE}: format version {data.get('version')!r}, this build reads "
            f"{BUFFER_VERSION}"
        )
    for key, now in (("prompts_per_step", prompts_per_step), ("n_samples_per_prompt", n_samples)):
        if data[key] != now:
            raise ValueError(
                f"the checkpoint's rollout buffer holds groups of rollout.{key} {data[key]}, the "
                f"config has {now}: resume with rollout.{key}={data[key]} (buffered groups "
                "belong to steps of that shape)"
            )
    saved = data.get("stale_policy")
    if stale_policy is not None and saved is not None and saved != stale_policy:
        # pace takes groups by index; drop / retry skip indices, which pace would wait for
        raise ValueError(
            f"the checkpoint's rollout buffer was filled with rollout.mode_options.stale_policy {saved}, the "
            f"config has {stale_policy}: resume with rollout.mode_options.stale_policy={saved}"
        )


def buffered_groups(data: dict[str, Any] | None) -> int:
    """How many groups a buffer holds (0 for none)."""
    return len(data["groups"]) if data else 0
