"""Supervised fine-tuning flow: the warm start of a policy before RL.

    prepare model → SFT steps (masked cross-entropy on reference answers) → save HF dir

Run it alone with `miles sft --config FILE`, or let `flows/rl_train.py` call it when the config
has an `sft:` section.
"""

from __future__ import annotations

import shutil

from prefect import flow

from flows.prefect_server import send_to_api
from miles_core.checkpoint.run_lock import RunClaim
from miles_core.config import RunConfig
from miles_core.run.runtime import new_workdir
from tasks.setup import prepare_model, start_tracking
from tasks.sft import sft_train


@flow(name="sft", log_prints=True)
def sft(config: RunConfig, parent_run_id: str | None = None) -> str:
    if config.sft is None:
        raise ValueError("the sft flow needs an `sft:` section in the config")
    send_to_api("miles")  # the SFT progress lines, in the flow run's logs in the Prefect UI
    ck = config.checkpoint
    with RunClaim(ck.root, [f"{config.name}-sft"], ck.storage_options):  # checkpoint/run_lock.py
        tracker = start_tracking(config, f"{config.name}-sft", parent_run_id)
        workdir = new_workdir()  # the starting model; the result is saved to the checkpoint root
        try:
            return sft_train(config, prepare_model(config, workdir), tracker)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
