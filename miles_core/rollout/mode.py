"""Rollout modes: how generation, training and weight pushes interleave (`rollout.mode`).

A mode is a class in `rollout/modes/` (`@MODES.register(name)`) or one named by import path; its
settings are its `Options` (`rollout.mode_options`). What the run asks of it:

- `ahead`: a rollout producer generates ahead of the trainer (an engine server is needed, and
  the engine shares the machine with a training trainer); else each step generates, then trains;
- `staleness(options)`: the producer's bound and policy (`Staleness`);
- `drains_before_push`: the batch in flight finishes on the old weights before a push;
- `overlaps_push(options)`: the trainer hands each policy over as a snapshot and trains on while
  it is pushed (the push stays bitwise-checked against the snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from miles_core.plugins import NoOptions, PluginOptions, Registry, subclass_of


@dataclass(frozen=True)
class Staleness:
    """How far a trained sample may lag the trainer, and what happens to one that would lag
    more: `pace` admission so none does, or admit freely and `drop` / `retry` stale groups."""

    max_staleness: int = 0
    policy: Literal["pace", "drop", "retry"] = "pace"
    watchdog_s: float = 60.0


class AsyncOptions(PluginOptions):
    """What every mode with a producer takes."""

    watchdog_s: float = Field(
        60.0,
        gt=0,
        description="when no rollout group completes for this long, the run logs what it waits "
        "on (again every watchdog_s)",
    )


class RolloutMode:
    Options: type[PluginOptions] = NoOptions
    ahead = False
    drains_before_push = False

    @classmethod
    def staleness(cls, options: Any) -> Staleness:
        return Staleness(watchdog_s=getattr(options, "watchdog_s", 60.0))

    @classmethod
    def overlaps_push(cls, options: Any) -> bool:
        return False


MODES: Registry[type[RolloutMode]] = Registry(
    "rollout mode",
    "rollout.mode",
    package="miles_core.rollout.modes",
    example="package.module:Mode",
    load=subclass_of(RolloutMode, "rollout mode"),
)
