"""A reward function that raises, hangs or returns NaN/inf fails only its sample: reward 0, a
zero loss mask, the reason in the sample, `rollout/failed_samples` counted; the step trains on
the others and the run goes on."""

import tempfile
import threading
from pathlib import Path

import pytest

from miles_core.config import load_config
from miles_core.data.tasks import SayA, Score
from miles_core.engines.wire import GenerateResponse
from miles_core.rollout.rollout_fn import build_group
from miles_core.rollout.scoring import call_with_timeout, safe_score
from miles_core.run.runtime import RLRuntime, prepare_model_dir
from miles_core.types import Status


class Flaky(SayA):
    """say_a, except for completions of a chosen kind, where the reward function misbehaves."""

    name = "flaky"

    def __init__(self, how: str = "raise"):
        self.how = how

    def score(self, completion, label):
        if completion.startswith("bad"):
            if self.how == "raise":
                raise KeyError("no grader for this")
            if self.how == "hang":
                threading.Event().wait()
            if self.how == "nan":
                return Score(float("nan"))
            if self.how == "inf":
                return Score(float("-inf"))
            if self.how == "number":
                return 1.0  # not a Score
        return super().score(completion, label)


class EveryOtherRaises(SayA):  # for a run: the reward function fails on half the calls
    name = "every_other_raises"

    def __init__(self):
        self.calls = 0

    def score(self, completion, label):
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("grader crashed")
        return super().score(completion, label)


def _response(text: str) -> GenerateResponse:
    return GenerateResponse.model_validate(
        {
            "text": text,
            "output_ids": [5, 6],
            "meta_info": {
                "finish_reason": {"type": "stop"},
                "prompt_tokens": 2,
                "completion_tokens": 2,
                "weight_version": "3",
                "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
            },
        }
    )


@pytest.mark.parametrize(
    "how, reason",
    [
        ("raise", "reward function raised KeyError('no grader for this')"),
        ("hang", "reward function timed out after 0.2 s"),
        ("nan", "non-finite reward (nan)"),
        ("inf", "non-finite reward (-inf)"),
        ("number", "reward function returned 1.0, not a Score with a number"),
    ],
)
def test_a_failing_reward_function_fails_only_its_sample(how, reason):
    from miles_core.data.tasks import Example

    ex = Example(prompt="say a", label=None)
    responses = [_response("aaaa"), _response("bad answer"), _response("abab")]
    group = build_group(Flaky(how), 0, 0, 3, 7, ex, [1, 2], responses, reward_timeout_s=0.2)
    good, bad, half = group.samples
    assert bad.status == Status.FAILED and bad.reward == 0.0 and bad.loss_mask == [0, 0]
    assert reason in bad.metadata["error"]
    assert good.reward == 1.0 and good.loss_mask == [1, 1] and good.status == Status.COMPLETED
    assert half.reward == 0.5 and "error" not in half.metadata
    for s in group.samples:
        s.validate()


def test_reward_calls_reuse_a_worker_thread_and_a_hung_one_is_never_reused():
    ident = threading.get_ident
    first = call_with_timeout(ident, (), 5)
    assert first != ident() and call_with_timeout(ident, (), 5) == first  # no thread per call
    release, hung = threading.Event(), []

    def hang():
        hung.append(ident())
        release.wait()

    with pytest.raises(TimeoutError, match="timed out after 0.1 s"):
        call_with_timeout(hang, (), 0.1)
    try:
        assert call_with_timeout(ident, (), 5) not in hung  # the next call got another worker
    finally:
        release.set()  # the abandoned worker finishes the call and its thread ends


def test_safe_score_passes_a_good_score_through():
    score, error = safe_score(SayA(), "aa", None, timeout_s=5)
    assert error is None and score.reward == 1.0


def test_a_run_whose_reward_function_fails_half_the_time_keeps_training(tmp_path):
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=test_scoring:EveryOtherRaises",
            "data.num_prompts=8",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            f"checkpoint.root={tmp_path}/ckpt",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    try:
        for step in range(2):
            result = rt.rollout(step)
            failed = [s for s in result.samples if s.status == Status.FAILED]
            assert result.metrics["rollout/failed_samples"] == len(failed) == 4
            assert all("grader crashed" in s.metadata["error"] for s in failed)
            metrics = rt.train(result)
            assert metrics["train/grad_norm"] >= 0.0
            rt.update_weights()
    finally:
        rt.close()
