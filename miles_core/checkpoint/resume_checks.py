"""What a resume may change, checked against the checkpoint's saved config and buffer.

- A changed batch shape (prompts per step, group size, global / micro batch, trainer ranks) or,
  with a decaying LR schedule, a changed `train.num_steps` is allowed, with a warning: training
  continues correctly, but no longer bit-identically to an uninterrupted run (other batches,
  other reduction order, another LR curve).
- A checkpoint saved by another trainer backend is refused: optimizer state does not move
  between FSDP2 and Megatron (start a new run from its HF weights instead). Another Megatron
  layout (`train.parallel`) is resharded, with the warning above.
- A checkpoint that holds an async rollout buffer is refused when the buffer cannot be
  continued: `rollout.mode: sync` (no producer to hand the groups to) or another prompts per
  step / group size (the buffered groups belong to steps of the saved shape).
"""

from __future__ import annotations

from typing import Any

from miles_core.config import RunConfig
from miles_core.config.train import TrainConfig
from miles_core.rollout.buffer_state import BUFFER_FILE, buffered_groups, check_buffer
from miles_core.rollout.mode import MODES

SHAPE_FIELDS = (
    "rollout.prompts_per_step",
    "rollout.n_samples_per_prompt",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.world_size",
    "train.parallel",
)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def shape_changes(saved: dict[str, Any] | None, config: RunConfig) -> list[str]:
    """'field saved → now' for each setting that breaks bit-identity with an uninterrupted run
    ([] when the checkpoint has no saved config: written by an older version)."""
    if not saved:
        return []
    now = config.model_dump(mode="json")
    fields = list(SHAPE_FIELDS)
    if config.train.lr_decay_style != "constant":
        fields.append("train.num_steps")
    return [
        f"{f} {_get(saved, f)} → {_get(now, f)}"
        for f in fields
        if _get(saved, f) is not None and _get(saved, f) != _get(now, f)
    ]


def check_backend_resumable(saved: dict[str, Any] | None, config: RunConfig, step: int) -> None:
    """Raises ValueError when checkpoint `step` was saved by another trainer backend."""
    # a checkpoint from before the key existed was saved by the default backend
    before = _get(saved or {}, "train.backend") or TrainConfig.model_fields["backend"].default
    if before != config.train.backend:
        raise ValueError(
            f"--resume: checkpoint step {step} was saved by train.backend {before}, this run "
            f"uses {config.train.backend}: optimizer state does not move between backends; "
            f"resume with train.backend {before}, or start a new run from its HF weights "
            "(model.path: the checkpoint's directory)"
        )


def check_buffer_resumable(buffer: dict[str, Any] | None, config: RunConfig, step: int) -> None:
    """Raises ValueError when the checkpoint's rollout buffer cannot be continued."""
    if not buffered_groups(buffer):
        return
    assert buffer is not None
    r = config.rollout
    mode = MODES.get(r.mode)
    if not mode.ahead:
        raise ValueError(
            f"--resume: checkpoint step {step} holds {buffered_groups(buffer)} rollout groups of "
            f"an async run ({BUFFER_FILE}) that rollout.mode sync cannot continue: resume with "
            "rollout.mode fully_async or one_step_off"
        )
    policy = mode.staleness(r.mode_options).policy  # what the producer uses
    check_buffer(buffer, r.prompts_per_step, r.n_samples_per_prompt, policy)
