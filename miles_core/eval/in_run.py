"""Evaluation inside a training run: when a policy version is due, which evaluator scores it,
and how an outcome becomes `eval/*` points at the version's step.

Every outcome is logged at step = the policy version it measured, with
`eval/policy_version`, `eval/lag_steps` (policy versions trained since, when the score came
back: 0 for shared), `eval/errors` (1 for a failed, timed-out or skipped evaluation),
`eval/time_s` and `eval/weights_match` (the measured weights' sha256 equals the checkpoint's).
Run tags `eval.v<N>.weights_sha256` / `eval.v<N>.error` keep the checksum and the reason.
A registered version also gets its scores as tags, and `best-eval` follows the best score.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from miles_core.eval.evaluators import BackgroundEvaluator, EvalJob, EvalOutcome, SharedEvaluator
from miles_core.eval.mode import EVAL_MODES
from miles_core.eval.scoring import EvalSpec

log = logging.getLogger("miles.eval")

# scores the weights the rollout engine serves now: (eval/* metrics, their sha256)
SharedScore = Callable[[], tuple[dict[str, float], str | None]]


class RunEvaluation:
    def __init__(
        self,
        config,  # RunConfig
        tracker,  # Tracker | None
        shared_score: SharedScore,
        hold: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        current_version: Callable[[], int] = lambda: 0,
    ):
        self.config = config
        self.tracker = tracker
        self.hold = hold
        self.current_version = current_version
        agentic = config.agent.function is not None  # agent.eval_episodes: on the engine
        self.mode = "shared" if agentic else config.eval.mode
        self.kind = EVAL_MODES.get(self.mode)
        options = self.kind.Options() if agentic else config.eval.mode_options
        self.every = config.agent.eval_every if agentic else config.eval.every
        self.checkpoints: dict[int, tuple[str, str | None, str | None]] = {}
        timeout = config.eval.timeout_s
        self._runner = None
        if not self.kind.background:

            def run_shared(job: EvalJob, deadline: float):
                with self.hold():  # async producers admit no new group meanwhile
                    return shared_score()

            self.evaluator: Any = SharedEvaluator(run_shared, timeout, current_version)
        else:
            self._runner = self.kind.runner(config, options, EvalSpec.from_run(config))
            self.evaluator = BackgroundEvaluator(
                self._runner, timeout, options.max_in_flight, self.mode, current_version
            )

    @property
    def background(self) -> bool:
        """Evaluations run beside training (dedicated, external), not on the rollout engine
        between steps (shared)."""
        return self.kind.background

    @staticmethod
    def wanted(config) -> bool:
        if config.agent.function is not None:
            return config.agent.eval_episodes > 0
        return EVAL_MODES.get(config.eval.mode).enabled

    def due(self, version: int) -> bool:
        """The starting policy (shared only: the others score checkpoints), every `every`
        versions, and the last."""
        if version == 0:
            return not self.kind.background
        last = self.config.train.num_steps
        return version == last or bool(self.every and version % self.every == 0)

    def record_checkpoint(
        self, version: int, uri: str, model_version: str | None, sha256: str | None
    ) -> None:
        self.checkpoints[version] = (uri, model_version, sha256)

    def submit(self, version: int, sha256: str | None = None) -> None:
        uri, model_version, saved_sha = self.checkpoints.get(version, (None, None, None))
        job = EvalJob(version, saved_sha or sha256, uri, model_version)
        if self.kind.background and uri is None:
            reason = f"no checkpoint of policy version {version} to evaluate (its save failed?)"
            self.evaluator.fail(job, reason)
            return
        self.evaluator.submit(job)

    def finished(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(version, metrics) of every evaluation that ended since the last call."""
        out = []
        for o in self.evaluator.finished(wait):
            out.append((o.job.version, self._metrics(o)))
        return out

    def _metrics(self, o: EvalOutcome) -> dict[str, float]:
        v = o.job.version
        metrics = dict(o.metrics) | {
            "eval/policy_version": float(v),
            "eval/lag_steps": float(max(0, o.version_at_end - v)),
            "eval/errors": 1.0 if o.error else 0.0,
            "eval/time_s": o.seconds,
        }
        if o.job.weights_sha256 and o.measured_sha256:
            metrics["eval/weights_match"] = float(o.job.weights_sha256 == o.measured_sha256)
            if o.job.weights_sha256 != o.measured_sha256:
                log.warning(
                    "evaluation of policy version %d measured weights %s, not the checkpoint's %s",
                    v,
                    o.measured_sha256[:12],
                    o.job.weights_sha256[:12],
                )
        if self.tracker is not None:
            tags = {f"eval.v{v}.weights_sha256": str(o.measured_sha256)}
            if o.error:
                tags[f"eval.v{v}.error"] = o.error[:5000]
            try:  # bookkeeping: a tracking-server hiccup must not stop training
                self.tracker.set_tags(tags)
                if o.job.model_version and not o.error:
                    from miles_core.eval.registry import mark_version

                    mark_version(
                        self.tracker.client, self.config.name, o.job.model_version, metrics
                    )
            except Exception as e:  # noqa: BLE001
                log.warning("could not record the evaluation of version %d in MLflow: %r", v, e)
        return metrics

    def close(self) -> None:
        if self._runner is not None and hasattr(self._runner, "close"):
            self._runner.close()
        self.evaluator.close()
