"""The trainer of an RL run: the backend chosen by `train.backend` (`train/backend.py: BACKENDS`)
and the RL train phase on it — the advantages of the rollout's groups (`train.advantage_estimator`,
`train/advantage.py: ADVANTAGES`), one
`TrainBatch`, the old log-probs, one optimizer step per `train.global_batch_size` rollouts with
the loss named by `train.loss`. With one optimizer step per rollout the old log-probs are the
training forward's own (`TrainBatch.old_is_current`); with several, they are recomputed first."""

from __future__ import annotations

from pathlib import Path

from miles_core.precision.plan import QuantPlan
from miles_core.rollout.mode import MODES
from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.train.advantage import ADVANTAGES
from miles_core.train.backend import BACKENDS, TrainerBackend
from miles_core.train.batch import TrainBatch, rollout_slices
from miles_core.true_on_policy.behaviour import behaviour_log_probs
from miles_core.true_on_policy.contract import TRUE_ON_POLICY
from miles_core.types import SampleGroup


def build_trainer(config, model_dir: Path, cluster=None) -> TrainerBackend:
    """The trainer backend of `config.train`, loaded from the HF directory `model_dir`, built
    where `cluster` (the run's `cluster/backend.py: Cluster`; none: in this process) puts its
    ranks. Its settings are `config.train`'s, plus, with `train.true_on_policy`, the compute
    dtype of the invariant forward it shares with the engines (`true_on_policy_dtype`), and
    with `train.qat` the format and keep-list its forward fake-quantizes with
    (`qat_precision`)."""
    train = config.train
    settings = train.model_dump()
    if train.true_on_policy:
        settings["true_on_policy_dtype"] = TRUE_ON_POLICY.dtype(config)
    if train.qat:
        settings["qat_precision"] = QuantPlan.spec_of(config)
    kwargs = dict(
        model_dir=str(model_dir),
        optim=settings,
        loss=train.model_dump(),
        total_steps=train.num_steps * config.optimizer_steps_per_rollout,
        seed=config.seed,
        device=train.device,
    )
    if cluster is None:
        return BACKENDS.get(train.backend)(**kwargs)
    return cluster.trainer(train.backend, kwargs)


def adapters_of(groups: list[SampleGroup]) -> dict[str, list[SampleGroup]]:
    """A multi-LoRA rollout's groups by the adapter they were generated with."""
    out: dict[str, list[SampleGroup]] = {}
    for g in groups:
        if g.samples:
            out.setdefault(g.samples[0].metadata.get("adapter", ""), []).append(g)
    return out


def train_on_rollout(
    trainer: TrainerBackend, config, result: RolloutResult, version: int = 0
) -> dict[str, float]:
    """The optimizer steps of one rollout by `trainer`, which holds policy `version`; returns
    their `train/*` metrics, averaged. With several LoRA adapters, each adapter steps on its own
    groups alone (its loss normalised over them, its own optimizer): the update each would get
    trained alone; `train/<key>/<adapter>` beside the mean over adapters."""
    lora = config.train.lora
    if lora is None or len(lora.adapters) == 1:
        return _train_groups(trainer, config, result.groups, version)
    per_adapter = {}
    for name, groups in adapters_of(result.groups).items():
        trainer.use_adapter(name)
        per_adapter[name] = _train_groups(trainer, config, groups, version)
    keys = next(iter(per_adapter.values())).keys()
    metrics = {k: sum(m[k] for m in per_adapter.values()) / len(per_adapter) for k in keys}
    for name, m in per_adapter.items():
        metrics |= {f"{k}/{name}": v for k, v in m.items()}
    return metrics


def _train_groups(
    trainer: TrainerBackend, config, groups: list[SampleGroup], version: int
) -> dict[str, float]:
    train = config.train
    estimate = ADVANTAGES.get(train.advantage_estimator)
    advantages = estimate(groups, train.advantage_estimator_options)
    samples = [s for g in groups for s in g.samples]
    batch = TrainBatch.from_samples(samples, advantages, config.rollout.temperature)
    batch.advantage_transforms = dict(train.advantage_transforms)
    # global_batch_size counts rollouts: a multi-leaf agent episode stays in one step
    slices = rollout_slices(batch.sample_ids, config.train.global_batch_size)
    if len(slices) == 1 and not trainer.stochastic_forward:  # π_old is the policy it trains
        batch.old_is_current = True
    else:  # several steps need the weights before the first; dropout: a no-grad forward
        batch.old_log_probs = trainer.compute_log_probs(batch)
    if train.true_on_policy:  # stale tokens under the weights that generated them
        r = config.rollout
        lag = MODES.get(r.mode).staleness(r.mode_options).max_staleness
        batch.behaviour_log_probs = behaviour_log_probs(trainer, batch, version, lag)
    per_step: list[dict[str, float]] = []
    for start, end in slices:
        per_step.append(trainer.train_step(batch.slice(start, end), loss=config.train.loss))
    keys = per_step[0].keys()
    return {f"train/{k}": sum(m[k] for m in per_step) / len(per_step) for k in keys}
