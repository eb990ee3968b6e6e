"""Scoring a policy on fixed evaluation prompts: the one function every evaluation mode uses
(shared: the rollout engine; dedicated: an engine server loaded from a checkpoint; external and
the standalone flow: an engine in the evaluating process)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from miles_core.config import RolloutConfig
from miles_core.data.tasks import TASKS, Example, Task
from miles_core.engines.protocol import RolloutEngine, shared_generator
from miles_core.rollout.rollout_fn import generate_groups

EVAL_STEP = -1  # the `step` of evaluation requests (rids "-1-g-k"; training steps are >= 0)


@dataclass(frozen=True)
class EvalSpec:
    """What an evaluation measures: which prompts, how they are decoded."""

    task: str
    prompts: int = 32
    seed: int = 1_000_003  # the prompts' seed (data.seed + eval.seed)
    max_new_tokens: int = 16
    greedy: bool = True
    temperature: float = 1.0

    @classmethod
    def from_run(cls, config) -> EvalSpec:
        """The evaluation of a run's config (`RunConfig`): its task, eval.* settings."""
        e = config.eval
        return cls(
            task=config.data.task,
            prompts=e.prompts,
            seed=config.data.seed + e.seed,
            max_new_tokens=e.max_new_tokens or config.rollout.max_new_tokens,
            greedy=e.greedy,
            temperature=config.rollout.temperature,
        )

    @classmethod
    def from_params(cls, params: dict[str, str], prompts: int | None = None) -> EvalSpec:
        """The evaluation of a run from its MLflow params (the flattened config)."""
        max_new = params.get("eval.max_new_tokens")
        return cls(
            task=params.get("data.task", "say_a"),
            prompts=prompts or int(params.get("eval.prompts", 32)),
            seed=int(params.get("data.seed", 0)) + int(params.get("eval.seed", 1_000_003)),
            max_new_tokens=int(max_new)
            if max_new not in (None, "None")
            else int(params.get("rollout.max_new_tokens", 16)),
            greedy=params.get("eval.greedy", "True") == "True",
            temperature=float(params.get("rollout.temperature", 1.0)),
        )

    def examples(self, task: Task) -> list[tuple[int, Example]]:
        return list(enumerate(task.generate(self.prompts, seed=self.seed)))

    def rollout_config(self) -> RolloutConfig:
        """The sampling of the evaluation's requests, seeded one by one (an engine that samples
        a whole batch from one generator ignores the seeds). Only the sampling fields are read:
        the engine is the one `score_policy` is given."""
        return RolloutConfig(
            prompts_per_step=self.prompts,
            n_samples_per_prompt=1,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=1 if self.greedy else -1,
        )


def score_policy(engine: RolloutEngine, tokenizer, spec: EvalSpec) -> dict[str, float]:
    """`eval/*` metrics of the weights `engine` serves now on the spec's prompts:
    `eval/reward_mean`, the task's own metrics (e.g. `eval/exact_match`), lengths. An engine
    with a shared sampling generator (the embedded one) gets it back as it was, so an
    evaluation never changes what training samples next."""
    task = TASKS.get(spec.task)
    generator = shared_generator(engine)  # in-process engines: put back as it was
    saved = generator.get_state() if generator is not None else None
    try:
        result = generate_groups(
            engine, tokenizer, task, spec.examples(task), spec.rollout_config(), EVAL_STEP
        )
    finally:
        if generator is not None:
            generator.set_state(saved)
    out = {
        f"eval/{key.removeprefix('rollout/')}": value
        for key, value in result.metrics.items()
        if key.startswith("rollout/") and key.removeprefix("rollout/") not in _ROLLOUT_ONLY
    }
    out["eval/prompts"] = float(spec.prompts)
    return out


_ROLLOUT_ONLY = {  # rollout metrics that say nothing about the policy
    "prefix_cache_hit_rate",
    "tokens_per_s",
    "weight_version/mean",
    "weight_version/min",
    "weight_version/max",
    "engine_active_requests",
    "engine_queue_depth",
    "engine_steps",
}


# concurrent `from_pretrained` calls in one process break it for good: a load swaps
# `PreTrainedModel.tie_weights` (a class attribute) for a no-op while it builds the model, two
# loads at once restore each other's swap, the no-op stays, and every later load keeps an
# untied meta-device `lm_head` ("can't convert meta device type tensor"); the evaluation
# service scores jobs on several threads, so loads take turns
_LOAD_LOCK = threading.Lock()


def score_model_dir(model_dir: str | Path, spec: EvalSpec) -> tuple[dict[str, float], str]:
    """Scores an HF directory (a checkpoint) with an engine in this process; returns the
    metrics and the sha256 of the weights it measured."""
    from miles_core.engines.cpu.embedded import EmbeddedEngine
    from miles_core.models import load_hf_dir
    from miles_core.weights import weights_checksum

    with _LOAD_LOCK:  # one load at a time per process (see _LOAD_LOCK)
        model, tokenizer = load_hf_dir(model_dir)
        engine = EmbeddedEngine(model, tokenizer, seed=0)
    checksum = weights_checksum(engine.named_tensors().items())
    return score_policy(engine, tokenizer, spec), checksum
