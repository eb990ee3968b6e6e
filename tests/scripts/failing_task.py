"""A task whose reward function fails on the second rollout: a real error inside a run."""

from miles_core.data.tasks import SayA, Score


class FailsOnSecondRollout(SayA):
    name = "fails_on_second_rollout"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, completion: str, label) -> Score:
        self.calls += 1
        if self.calls > 8:  # the first rollout scores 8 samples
            raise RuntimeError("reward function crashed")
        return super().score(completion, label)
