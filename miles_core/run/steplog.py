"""Per-step bookkeeping of the flow: timing split (rollout / train / sync / orchestration),
batched MLflow writes (`Tracker.flush_if_due`: at most one per `tracking.flush_interval_s`, on
this thread, charged to the next step's orchestration time), the progress line, and the run's
closing summary."""

from __future__ import annotations

import statistics
import time

from miles_core.run.progress import Reporter
from miles_core.run.tracking import SUCCESS_KEY, SUCCESS_MA_KEY, Tracker

MA_WIDTH = 9  # SUCCESS_MA_KEY's window


def trailing_mean(points: list[tuple[int, float]], step: int, width: int = MA_WIDTH) -> float:
    """The mean of the (step, value) points at `step` and the `width` - 1 steps before it."""
    window = [v for s, v in points if step - width < s <= step]
    return statistics.fmean(window)


PHASES = (
    "perf/rollout_time_s",
    "perf/train_time_s",
    "perf/weight_sync_time_s",
    "perf/checkpoint_time_s",
)


class StepLog:
    def __init__(self, tracker: Tracker, report: Reporter, total_steps: int):
        self.tracker = tracker
        self.report = report
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self._carry = 0.0  # time of the previous MLflow flush, charged to orchestration
        report.start(total_steps, "rl")

    def step(self, step: int, t0: float, *parts: dict[str, float], t_end: float = 0.0) -> None:
        """Logs step `step`'s metrics (`parts`); its time runs from `t0` to `t_end` (default:
        now), when the trainer was done with it (a push overlapped by the next step is not)."""
        metrics: dict[str, float] = {}
        for p in parts:
            metrics.update(p)
        step_time = (t_end or time.perf_counter()) - t0 + self._carry
        inner = sum(metrics.get(k, 0.0) for k in PHASES)
        metrics["perf/step_time_s"] = step_time
        metrics["perf/orchestration_time_s"] = max(0.0, step_time - inner)
        if SUCCESS_KEY in metrics:  # over the steps logged before (a resumed run's too; a step
            # run again after a resume counts once, as now)
            past = [(s, v) for s, v in self.tracker.history(SUCCESS_KEY) if s != step]
            metrics[SUCCESS_MA_KEY] = trailing_mean([*past, (step, metrics[SUCCESS_KEY])], step)
        self.history.append(metrics)
        if len(self.history) == 1:
            self.tracker.prepare_curve()  # the run's-end plot's import overlaps the steps
        t_flush = time.perf_counter()
        self.tracker.log_metrics(metrics, step)
        self.tracker.flush_if_due()
        self._carry = time.perf_counter() - t_flush
        fields = {"reward": metrics["rollout/reward_mean"], "step_s": step_time}
        if "rollout/exact_match" in metrics:
            fields["exact_match"] = metrics["rollout/exact_match"]
        self.report.update(step, fields)

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation of the policy after `step` training steps, logged at that step."""
        self.evals.append(metrics)
        self.tracker.log_metrics(metrics, step)
        self.tracker.flush()

    def finish(self) -> dict[str, float | str]:
        """Closes the MLflow run (reward-curve PNG attached); returns a summary of this invocation."""
        self.report.stop()
        if self.history:
            self.tracker.log_reward_curve()
        self.tracker.finish()
        if not self.history:
            return {"steps": 0.0, "mlflow_run_id": self.tracker.run_id}
        first, last = self.history[:5], self.history[-5:]
        summary: dict[str, float | str] = {
            "mlflow_run_id": self.tracker.run_id,
            "reward_first5": statistics.fmean(m["rollout/reward_mean"] for m in first),
            "reward_last5": statistics.fmean(m["rollout/reward_mean"] for m in last),
            "steps": float(len(self.history)),
        }
        if "rollout/exact_match" in self.history[0]:
            summary["exact_match_first5"] = statistics.fmean(
                m["rollout/exact_match"] for m in first
            )
            summary["exact_match_last5"] = statistics.fmean(m["rollout/exact_match"] for m in last)
        if len(self.evals) >= 2 and "eval/success_rate" in self.evals[0]:
            summary["eval_success_first"] = self.evals[0]["eval/success_rate"]
            summary["eval_success_last"] = self.evals[-1]["eval/success_rate"]
        return summary
