"""`one_step_off`: the next batch is generated while the trainer trains on this one; the batch in
flight finishes on the old weights, then the push (samples are one policy version old)."""

from __future__ import annotations

from miles_core.rollout.mode import MODES, AsyncOptions, RolloutMode, Staleness


@MODES.register("one_step_off")
class OneStepOff(RolloutMode):
    Options = AsyncOptions
    ahead = True
    drains_before_push = True

    @classmethod
    def staleness(cls, options: AsyncOptions) -> Staleness:
        return Staleness(max_staleness=1, policy="pace", watchdog_s=options.watchdog_s)
