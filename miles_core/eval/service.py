"""A reference evaluation service for `eval.mode: external` (the contract is in external.py):
it takes a checkpoint URI, scores it with an engine in its own process, and keeps the results
in memory. `miles eval serve --port 30200` / `python -m miles_core.eval.service --port 30200`.

Checkpoints on s3:// are read with fsspec's environment settings (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, FSSPEC_S3_ENDPOINT_URL)."""

from __future__ import annotations

import argparse
import sys
import threading
import uuid
from typing import Literal

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from miles_core.eval.scoring import EvalSpec, score_model_dir
from miles_core.proc.managed import KEEP_ALIVE_S, ManagedProcess
from miles_core.proc.ports import add_port_arguments, bind_from_args


class SpecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str
    prompts: int = Field(32, gt=0, le=4096)
    seed: int = 1_000_003
    max_new_tokens: int = Field(16, gt=0)
    greedy: bool = True
    temperature: float = Field(1.0, gt=0)


class JobBody(BaseModel):
    checkpoint_uri: str = Field(min_length=1)
    policy_version: int = Field(ge=0)
    step: int | None = None
    weights_sha256: str | None = None
    spec: SpecBody


class JobState(BaseModel):
    id: str
    status: Literal["pending", "running", "done", "failed"] = "pending"
    policy_version: int
    metrics: dict[str, float] = Field(default_factory=dict)
    weights_sha256: str | None = None
    error: str | None = None


def create_app() -> FastAPI:
    app = FastAPI(title="miles evaluation service")
    jobs: dict[str, JobState] = {}
    lock = threading.Lock()

    def work(job: JobState, body: JobBody) -> None:
        from miles_core.storage import local_model_dir

        job.status = "running"
        try:
            spec = EvalSpec(**body.spec.model_dump())
            with local_model_dir(body.checkpoint_uri) as local:
                metrics, sha = score_model_dir(local, spec)
            job.metrics = {k.removeprefix("eval/"): v for k, v in metrics.items()}
            job.weights_sha256 = sha
            job.status = "done"
        except Exception as e:  # noqa: BLE001  (reported to the client as a failed job)
            job.error = f"{type(e).__name__}: {e}"
            job.status = "failed"

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "jobs": len(jobs)}

    @app.post("/evaluations", status_code=202)
    def submit(body: JobBody) -> dict:
        from miles_core.data.tasks import get_task

        try:
            get_task(body.spec.task)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        job = JobState(id=uuid.uuid4().hex, policy_version=body.policy_version)
        with lock:
            jobs[job.id] = job
        threading.Thread(target=work, args=(job, body), daemon=True).start()
        return {"id": job.id}

    @app.get("/evaluations/{job_id}")
    def get(job_id: str) -> JobState:
        with lock:
            job = jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no evaluation {job_id!r}")
        return job

    return app


class EvalServiceProcess(ManagedProcess):
    """The service as a subprocess on 127.0.0.1, stopped by PID; `eval.url` is `.evaluations`."""

    what = "evaluation service"
    reports_port = True  # binds port 0 (or in `port_range`) itself and reports it

    def command(self) -> list[str]:
        return [sys.executable, "-m", "miles_core.eval.service", *self.port_args()]

    @property
    def evaluations(self) -> str:
        return f"{self.url}/evaluations"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="miles eval serve", description=__doc__)
    add_port_arguments(p, default_port=30200)
    args = p.parse_args(argv)
    sock = bind_from_args(args, "evaluation service")
    config = uvicorn.Config(
        create_app(),
        host=args.host,
        port=sock.getsockname()[1],
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    from miles_core.proc.fast_exit import exit_after

    exit_after(main)
