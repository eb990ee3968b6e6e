"""A reference evaluation service for `eval.mode: external` (the contract is in external.py):
it takes a checkpoint URI, scores it with an engine in its own process, and keeps the results
in memory. `miles eval serve --checkpoint-roots /ckpt --port 30200` /
`python -m miles_core.eval.service --checkpoint-roots /ckpt --port 30200`.

What a client may ask for is what the service was started with:
- tasks: `--tasks` (names or `package.module:object`, resolved at start-up; default: the
  built-in tasks); a job naming another task is 400 and nothing is imported for it;
- checkpoints: under `--checkpoint-roots` (local directories, fsspec prefixes such as
  `s3://bucket/prefix`; none by default: every checkpoint is refused until roots are given);
  another URI is 403 (400 when malformed), the same answer whether it exists or not
  (miles_core/processes/roots.py);
- jobs: at most `--max-jobs` kept (the oldest finished ones are dropped first; 429 when all are
  pending or running), run by `--workers` threads; models load one at a time (a lock in
  scoring.py: concurrent `from_pretrained` in one process leaves transformers' `tie_weights`
  swapped for a no-op, after which every load fails with "can't convert meta device type
  tensor"). A job's failure is its own.

Checkpoints on s3:// are read with fsspec's environment settings (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, FSSPEC_S3_ENDPOINT_URL)."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from miles_core.eval.scoring import EvalSpec, score_model_dir
from miles_core.processes.auth import protect
from miles_core.processes.http_limits import MAX_BODY_BYTES, BodyLimit
from miles_core.processes.managed import KEEP_ALIVE_S, ManagedProcess
from miles_core.processes.ports import add_port_arguments, announce, bind_from_args
from miles_core.processes.roots import AllowedRoots, MalformedUri, OutsideRoots

MAX_JOBS = 1024
WORKERS = 1


class SpecBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    task: str = Field(max_length=512)
    prompts: int = Field(32, gt=0, le=4096)
    seed: int = Field(1_000_003, ge=-(1 << 63), lt=1 << 63)
    max_new_tokens: int = Field(16, gt=0, le=1 << 20)
    greedy: bool = True
    temperature: float = Field(1.0, gt=0, le=1e6)


class JobBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    checkpoint_uri: str = Field(min_length=1, max_length=4096)
    policy_version: int = Field(ge=0, lt=1 << 63)
    step: int | None = Field(None, ge=-1, lt=1 << 63)
    weights_sha256: str | None = Field(None, max_length=128)
    spec: SpecBody


class JobState(BaseModel):
    id: str
    status: Literal["pending", "running", "done", "failed"] = "pending"
    policy_version: int
    metrics: dict[str, float] = Field(default_factory=dict)
    weights_sha256: str | None = None
    error: str | None = None


def resolve_tasks(tasks: Sequence[str] | None) -> tuple[str, ...]:
    """The task names a service scores: the built-ins by default; each named one (a built-in
    or an import path the operator chose) is loaded now, so a bad one stops the start-up."""
    from miles_core.data.tasks import TASKS

    if tasks is None:
        return tuple(TASKS.names())
    names = tuple(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    if not names:
        raise ValueError("--tasks names no task")
    for name in names:
        TASKS.get(name)  # ValueError naming the task for an unknown one
    return names


def create_app(
    tasks: Sequence[str] | None = None,
    checkpoint_roots: Sequence[str] | AllowedRoots = (),
    workers: int = WORKERS,
    max_jobs: int = MAX_JOBS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """`tasks`: the task names jobs may use (default: the built-ins); `checkpoint_roots`: where
    checkpoints may be read from (default: nowhere)."""
    from miles_core.checkpoint.store import local_model_dir

    served = resolve_tasks(tasks)
    roots = (
        checkpoint_roots
        if isinstance(checkpoint_roots, AllowedRoots)
        else AllowedRoots.parse(checkpoint_roots, "checkpoint root")
    )
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="miles-eval-job")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="miles evaluation service", lifespan=lifespan)
    app.add_middleware(
        BodyLimit,
        limit=max_body_bytes,
        respond=lambda status, message: JSONResponse({"detail": message}, status_code=status),
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError) -> JSONResponse:
        # the field and the rule, never the input: FastAPI's default echoes it, and an echoed
        # NaN cannot be encoded (that 422 was a 500)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'malformed body')}".removeprefix(": ")
        if first.get("type") == "json_invalid":
            message = f"the body is not JSON ({first.get('ctx', {}).get('error', '')})"
        return JSONResponse({"detail": message}, status_code=422)

    jobs: dict[str, JobState] = {}  # insertion order: the oldest first
    lock = threading.Lock()

    def work(job: JobState, uri: str, spec: EvalSpec) -> None:
        job.status = "running"
        try:
            with local_model_dir(uri) as local:
                metrics, sha = score_model_dir(local, spec)
            # finite values only: a NaN would make every later GET of the job unencodable
            job.metrics = {
                k.removeprefix("eval/"): v for k, v in metrics.items() if math.isfinite(v)
            }
            job.weights_sha256 = sha
            job.status = "done"
        except Exception as e:  # noqa: BLE001  (reported to the client as a failed job)
            job.error = f"{type(e).__name__}: {e}"[:5000]
            job.status = "failed"

    def admit(job: JobState) -> None:
        """Adds the job, dropping the oldest finished ones past `max_jobs`; 429 when every
        kept job is still pending or running."""
        with lock:
            while len(jobs) >= max_jobs:
                oldest = next((k for k, j in jobs.items() if j.status in ("done", "failed")), None)
                if oldest is None:
                    raise HTTPException(
                        429,
                        f"{len(jobs)} evaluations pending or running, the service's cap "
                        f"(--max-jobs {max_jobs}); retry later",
                    )
                del jobs[oldest]
            jobs[job.id] = job

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "jobs": len(jobs)}

    @app.post("/evaluations", status_code=202)
    def submit(body: JobBody) -> dict:
        if body.spec.task not in served:
            raise HTTPException(
                400,
                f"task {body.spec.task!r} is not served here (served: {', '.join(served)}; "
                "start the service with --tasks to serve others)",
            )
        try:
            uri = roots.check(body.checkpoint_uri, "checkpoint_uri")
        except OutsideRoots:
            raise HTTPException(
                403,
                f"checkpoint_uri {body.checkpoint_uri!r} is not under the service's checkpoint "
                f"roots ({roots.describe()}; start it with --checkpoint-roots to serve others)",
            ) from None
        except MalformedUri as e:
            raise HTTPException(400, str(e)) from None
        job = JobState(id=uuid.uuid4().hex, policy_version=body.policy_version)
        admit(job)
        pool.submit(work, job, uri, EvalSpec(**body.spec.model_dump()))
        return {"id": job.id}

    @app.get("/evaluations/{job_id}")
    def get(job_id: str) -> JobState:
        with lock:
            job = jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no evaluation {job_id[:64]!r}")
        return job

    return app


class EvalServiceProcess(ManagedProcess):
    """The service as a subprocess on 127.0.0.1, stopped by PID; `eval.mode_options.url` is `.evaluations`.
    `checkpoint_roots`, `tasks`: as `--checkpoint-roots`, `--tasks`; `args`: further flags."""

    what = "evaluation service"
    reports_port = True  # binds port 0 (or in `port_range`) itself and reports it

    def __init__(
        self,
        *a,
        checkpoint_roots: Sequence[str] = (),
        tasks: Sequence[str] | None = None,
        args: Sequence[str] = (),
        **kw,
    ):
        super().__init__(*a, **kw)
        self.extra = [f"--checkpoint-roots={r}" for r in checkpoint_roots]
        self.extra += [f"--tasks={t}" for t in tasks or ()]
        self.extra += list(args)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "miles_core.eval.service", *self.port_args(), *self.extra]

    @property
    def evaluations(self) -> str:
        return f"{self.url}/evaluations"


def _positive(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {n}")
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="miles eval serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_port_arguments(p, default_port=30200)
    p.add_argument(
        "--checkpoint-roots",
        action="append",
        default=[],
        metavar="ROOT",
        help="a local directory or fsspec prefix (s3://bucket/prefix) checkpoints may be read "
        "from (repeatable, or comma-separated); none by default: every checkpoint is refused",
    )
    p.add_argument(
        "--tasks",
        action="append",
        default=None,
        metavar="TASK",
        help="a task jobs may use: a name or package.module:object (repeatable, or comma-"
        "separated); default: the built-in tasks",
    )
    p.add_argument("--workers", type=_positive, default=WORKERS, help="jobs scored at once")
    p.add_argument(
        "--max-jobs", type=_positive, default=MAX_JOBS, help="jobs kept (finished ones dropped)"
    )
    args = p.parse_args(argv)
    split = lambda values: [v for value in values for v in value.split(",")]  # noqa: E731
    try:  # bad settings stop the start-up, before the port is bound
        tasks = resolve_tasks(split(args.tasks)) if args.tasks is not None else None
        roots = AllowedRoots.parse(split(args.checkpoint_roots), "checkpoint root")
    except ValueError as e:
        p.error(str(e))
    sock = bind_from_args(args, "evaluation service")
    config = uvicorn.Config(
        # the key on every route but /health (processes/auth.py)
        protect(
            create_app(tasks, roots, workers=args.workers, max_jobs=args.max_jobs), args.api_key
        ),
        host=args.host,
        port=sock.getsockname()[1],
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    announce(sock, "evaluation service")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    from miles_core.processes.fast_exit import exit_after

    exit_after(main)
