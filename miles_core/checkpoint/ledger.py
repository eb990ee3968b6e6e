"""Which samples each step trained, kept in the checkpoints (`trained_samples.json`).

Each checkpoint holds the steps since the previous checkpoint of its lineage and names that
checkpoint (`previous_step`), so walking back from any checkpoint gives exactly what the
weights in it were trained on, step by step: steps a killed process trained after its last
checkpoint are in no file (their effect is gone with the process), and checkpoints of an
abandoned lineage (after `--resume-step` to an earlier one) are skipped by the walk.

A sample is named by its `rollout_id` (`s{step}-g{group}-{k}`, the group index over the run),
beside the dataset row it was drawn from and the policy versions that generated it.
"""

from __future__ import annotations

from typing import Any

from miles_core.types import SampleGroup

LEDGER_FILE = "trained_samples.json"
LEDGER_VERSION = 1


class TrainedLedger:
    """The steps trained since the last successful save (rank 0 of the trainer)."""

    def __init__(self, previous_step: int | None = None):
        self.previous_step = previous_step
        self._steps: dict[int, dict[str, list]] = {}  # step → per-sample lists

    def record(self, step: int, groups: list[SampleGroup]) -> None:
        samples = [s for g in groups for s in g.samples]
        self._steps[step] = {
            "sample_ids": [s.rollout_id for s in samples],
            "data_indices": [s.metadata.get("data_index") for s in samples],
            "weight_versions": [list(s.weight_versions) for s in samples],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "version": LEDGER_VERSION,
            "previous_step": self.previous_step,
            "steps": {str(k): v for k, v in sorted(self._steps.items())},
        }

    def saved(self, step: int) -> None:
        """The checkpoint of `step` holds what was recorded: the next one starts after it."""
        self.previous_step = step
        self._steps.clear()


def read_lineage(store, step: int) -> dict[int, dict[str, list]]:
    """{step: {"sample_ids", "data_indices", "weight_versions"}} of every step the checkpoint `step` was trained
    on, following `previous_step` back to the start of the run. `store` is a CheckpointStore."""
    out: dict[int, dict[str, list]] = {}
    at: int | None = step
    while at is not None:
        data = store.read_json(at, LEDGER_FILE)
        if data is None:
            raise FileNotFoundError(
                f"checkpoint step {at} of run {store.run_name!r} has no {LEDGER_FILE} "
                "(written by an older version)"
            )
        for k, v in data["steps"].items():
            out.setdefault(int(k), v)
        at = data.get("previous_step")
    return dict(sorted(out.items()))
