from __future__ import annotations

from pathlib import Path

from miles_core.config import RunConfig
from miles_core.run.tracking import Tracker
from miles_core.train.sft import run_sft
from tasks._task import step_task


@step_task(name="sft_train")
def sft_train(config: RunConfig, model_dir: Path, tracker: Tracker) -> str:
    """Supervised warm start; returns the URI of the fine-tuned HF directory."""
    return run_sft(config, model_dir, tracker)
