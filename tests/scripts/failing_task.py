"""A task whose reward function stops the process on the second rollout (`SystemExit`): a real
error inside a run that is not contained to one sample (an exception would only fail its
sample, see tests/test_scoring.py)."""

from miles_core.data.tasks import SayA, Score


class FailsOnSecondRollout(SayA):
    name = "fails_on_second_rollout"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, completion: str, label) -> Score:
        self.calls += 1
        if self.calls > 8:  # the first rollout scores 8 samples
            raise SystemExit("reward function stopped the run")
        return super().score(completion, label)
