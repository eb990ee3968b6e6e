"""External evaluation: POST the checkpoint URI and version to a service, poll for the result.

The contract (served by `miles_core/eval/service.py`, `miles eval serve`):

    POST {url}        {"checkpoint_uri", "policy_version", "step" (of the checkpoint: version − 1),
                       "weights_sha256", "spec": {...}}
                      → 200/201/202 {"id": "..."}
    GET  {url}/{id}   → {"status": "pending" | "running" | "done" | "failed",
                         "metrics": {"reward_mean": ..., ...}, "weights_sha256": "...",
                         "error": "..."}
"""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx

from miles_core.engines.http import error_message
from miles_core.eval.evaluators import EvalJob
from miles_core.eval.scoring import EvalSpec
from miles_core.processes.auth import bearer


class ExternalEvalFailed(RuntimeError):
    """The evaluation service refused the job or reported it failed."""


class ExternalRunner:
    def __init__(self, url: str, spec: EvalSpec, poll_s: float = 1.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = bearer(api_key)  # the service's key (`miles eval serve` with a key)
        self.spec = spec
        self.poll_s = poll_s
        self._stop = threading.Event()

    def __call__(self, job: EvalJob, deadline: float) -> tuple[dict[str, float], str | None]:
        if self._stop.is_set():
            raise ExternalEvalFailed("the run is shutting down")
        body = {
            "checkpoint_uri": job.checkpoint_uri,
            "policy_version": job.version,
            "step": job.version - 1,  # the checkpoint's training step (version N = step N - 1)
            "weights_sha256": job.weights_sha256,
            "spec": dataclasses.asdict(self.spec),
        }
        timeout = httpx.Timeout(30.0, connect=5.0)
        with httpx.Client(timeout=timeout, headers=self.headers) as client:
            r = _call(client.post, self.url, json=body)
            job_id = r.json()["id"]
            while True:
                data = _call(client.get, f"{self.url}/{job_id}").json()
                status = data.get("status")
                if status == "done":
                    metrics = {
                        k if k.startswith("eval/") else f"eval/{k}": float(v)
                        for k, v in data.get("metrics", {}).items()
                    }
                    return metrics, data.get("weights_sha256")
                if status == "failed":
                    raise ExternalEvalFailed(f"{self.url} job {job_id}: {data.get('error')}")
                if time.monotonic() + self.poll_s > deadline:
                    raise TimeoutError(f"{self.url} job {job_id} still {status!r} at the timeout")
                if self._stop.wait(self.poll_s):
                    raise ExternalEvalFailed("the run is shutting down")

    def close(self) -> None:
        self._stop.set()


def _call(method, url: str, **kwargs) -> httpx.Response:
    try:
        r = method(url, **kwargs)
    except httpx.HTTPError as e:
        raise ExternalEvalFailed(f"evaluation service {url} unreachable: {e!r}") from e
    if r.status_code >= 300:
        raise ExternalEvalFailed(f"{url} answered HTTP {r.status_code}: {error_message(r.text)}")
    return r
