"""Per-step bookkeeping of the flow: timing split (rollout / train / sync / orchestration),
one batched MLflow write per step, the progress line, and the run's closing summary."""

from __future__ import annotations

import statistics
import time

from miles_core.progress import Reporter
from miles_core.tracking import Tracker

PHASES = ("perf/rollout_time_s", "perf/train_time_s", "perf/weight_sync_time_s")


class StepLog:
    def __init__(self, tracker: Tracker, report: Reporter, total_steps: int):
        self.tracker = tracker
        self.report = report
        self.history: list[dict[str, float]] = []
        self._carry = 0.0  # time of the previous MLflow flush, charged to orchestration
        report.start(total_steps, "rl")

    def step(
        self, step: int, t0: float, *parts: dict[str, float], policy_version: int, saved: str | None
    ) -> None:
        metrics: dict[str, float] = {}
        for p in parts:
            metrics.update(p)
        step_time = time.perf_counter() - t0 + self._carry
        inner = sum(metrics.get(k, 0.0) for k in PHASES)
        metrics["perf/step_time_s"] = step_time
        metrics["perf/orchestration_time_s"] = max(0.0, step_time - inner)
        metrics["rollout/policy_version"] = float(policy_version)
        self.history.append(metrics)
        t_flush = time.perf_counter()
        self.tracker.log_metrics(metrics, step)
        self.tracker.flush()
        if saved is not None:
            self.tracker.set_tags({"miles.last_checkpoint": saved})
        self._carry = time.perf_counter() - t_flush
        self.report.update(
            step,
            {"reward": metrics["rollout/reward_mean"], "step_s": step_time}
            | _maybe(metrics, "rollout/exact_match"),
        )

    def finish(self) -> dict[str, float]:
        self.report.stop()
        self.tracker.log_reward_curve()
        self.tracker.finish()
        last = self.history[-5:]
        summary = {
            "reward_first5": statistics.fmean(m["rollout/reward_mean"] for m in self.history[:5]),
            "reward_last5": statistics.fmean(m["rollout/reward_mean"] for m in last),
            "steps": float(len(self.history)),
        }
        if "rollout/exact_match" in self.history[0]:
            summary["exact_match_first5"] = statistics.fmean(
                m["rollout/exact_match"] for m in self.history[:5]
            )
            summary["exact_match_last5"] = statistics.fmean(m["rollout/exact_match"] for m in last)
        return summary


def _maybe(metrics: dict[str, float], key: str) -> dict[str, float]:
    return {key.split("/")[-1]: metrics[key]} if key in metrics else {}
