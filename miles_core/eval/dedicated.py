"""Dedicated evaluation: a separate engine server loaded from the version's checkpoint scores
it while training keeps going, then stops (by PID, also when the job fails). Each of those
servers requires a random key of this runner's (processes/auth.py), which only its client knows."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from miles_core.eval.evaluators import EvalJob
from miles_core.eval.scoring import EvalSpec, score_policy
from miles_core.processes.auth import new_key


class DedicatedRunner:
    def __init__(
        self,
        spec: EvalSpec,
        storage_options: dict[str, Any] | None = None,
        threads: int = 1,
        port_range: Any = None,  # miles_core.processes.ports.PortRange | str | None: network.port_range
    ):
        self.spec = spec
        self.storage_options = storage_options or {}
        self.threads = threads
        self.port_range = port_range
        self.api_key = new_key()
        self.logs = Path(tempfile.mkdtemp(prefix="miles-eval-"))
        self._stop = threading.Event()

    def __call__(self, job: EvalJob, deadline: float) -> tuple[dict[str, float], str | None]:
        from miles_core.checkpoint.store import local_model_dir

        if not job.checkpoint_uri:
            raise ValueError(f"policy version {job.version} has no checkpoint to evaluate")
        if self._stop.is_set():
            raise RuntimeError("the run is shutting down")
        with local_model_dir(job.checkpoint_uri, self.storage_options) as local:
            return self._score(job, local, deadline)

    def _score(self, job: EvalJob, local: Path, deadline: float):
        from transformers import AutoTokenizer

        from miles_core.engines.http import EngineProcess, HttpEngine

        tokenizer = AutoTokenizer.from_pretrained(str(local))
        args = ["--threads", str(self.threads), "--max-running", str(self.spec.prompts)]
        process = EngineProcess(
            local,
            args=args,
            log_path=self.logs / f"v{job.version}.log",
            port_range=self.port_range,
            api_key=self.api_key,
        )
        try:
            process.start(timeout=_left(deadline))
            engine = HttpEngine(
                process.url,
                concurrency=self.spec.prompts,
                request_timeout=_left(deadline),
                api_key=self.api_key,
            )
            try:
                checksum = engine.weights_checksum()
                return score_policy(engine, tokenizer, self.spec), checksum
            finally:
                engine.close()
        finally:
            process.stop()

    def close(self) -> None:
        self._stop.set()
        shutil.rmtree(self.logs, ignore_errors=True)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the evaluation's time ran out")
    return left
