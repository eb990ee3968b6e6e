"""`fully_async`: a producer keeps the engine servers busy, weights are pushed while they
generate, and each trained sample is at most `max_staleness` policy versions old."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_core.rollout.mode import MODES, AsyncOptions, RolloutMode, Staleness


class FullyAsyncOptions(AsyncOptions):
    max_staleness: int = Field(1, ge=0, description="most policy versions a sample may lag")
    stale_policy: Literal["pace", "drop", "retry"] = Field(
        "pace",
        description="pace admission so no sample exceeds max_staleness (default), or admit "
        "freely and drop / requeue stale groups",
    )
    overlap_push: bool = Field(
        True,
        description="the trainer hands each new policy over as a snapshot and trains the next "
        "step while it is pushed (checked bitwise against the snapshot with "
        "weight_sync.check_equal); false: it waits for each push. A transport that cannot push "
        "from a snapshot (p2p sends each rank's shards) always waits",
    )


@MODES.register("fully_async")
class FullyAsync(RolloutMode):
    Options = FullyAsyncOptions
    ahead = True

    @classmethod
    def staleness(cls, options: FullyAsyncOptions) -> Staleness:
        return Staleness(options.max_staleness, options.stale_policy, options.watchdog_s)

    @classmethod
    def overlaps_push(cls, options: FullyAsyncOptions) -> bool:
        return options.overlap_push
