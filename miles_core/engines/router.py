"""SGLang's own router (the `sglang-router` package, "SGLang Model Gateway") in front of engines.

`RouterProcess` launches it on 127.0.0.1 with the `manual` policy: a request's routing key
(header `X-SMG-Routing-Key`, set by `HttpEngine` from `GenerateRequest.routing_key`) sticks to
one engine, so a session's turns hit the engine that holds its prefix; new keys are placed by the
router's `min_group` assignment (observed: not a strict balance). The router health-checks its workers and stops sending to one
that fails; `remove_worker` / `add_worker` let the runtime quarantine an engine and re-admit it
once it serves the current weight version. Stopped by PID like the engines.

Key: with `api_key` (the engines' key: sglang-router's `--api-key`) the router requires
`Authorization: Bearer` from its clients, its `/workers` routes included, and sends it to its
workers (tests/test_auth.py); our calls to it send it. The router is started through
`router_main.py`, which hands it the key from the environment: the key never appears on a
command line (`ps`), and the router exits with the process that started it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

from miles_core.engines.http import ROUTING_KEY_HEADER
from miles_core.processes.managed import ManagedProcess
from miles_core.processes.ports import PortRange, free_port

__all__ = ["ROUTING_KEY_HEADER", "RouterProcess"]


class RouterProcess(ManagedProcess):
    what = "sglang-router"

    def __init__(
        self,
        worker_urls: list[str],
        port: int | None = None,
        health_interval_s: int = 1,
        health_failures: int = 2,
        log_path: str | Path | None = None,
        port_range: PortRange | str | None = None,
        api_key: str | None = None,
    ):
        # sglang-router binds the port it is given and cannot report one it picked: the port
        # is probed here (ports.free_port, inside `port_range` when set)
        super().__init__(port=port, log_path=log_path, port_range=port_range, api_key=api_key)
        # its Prometheus exporter: loopback, on a port of its own (the default, 0.0.0.0:29000,
        # is open to the network and taken by the first router on the machine)
        self.metrics_port = free_port(self.host, self.port_range)
        self.worker_urls = list(worker_urls)
        self.health_interval_s = health_interval_s
        self.health_failures = health_failures

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_core.engines.router_main",  # the key from the environment (child_env)
            "launch",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            "manual",
            "--assignment-mode",
            "min_group",
            "--health-check-interval-secs",
            str(self.health_interval_s),
            "--health-failure-threshold",
            str(self.health_failures),
            "--health-success-threshold",
            "1",
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.metrics_port),
        ]

    def workers(self) -> list[dict]:
        """The router's view: [{"url", "id", "is_healthy", "load", ...}]."""
        r = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5.0)
        r.raise_for_status()
        return list(r.json().get("workers", []))

    def healthy_urls(self) -> list[str]:
        return [w["url"] for w in self.workers() if w.get("is_healthy")]

    def add_worker(self, url: str, timeout: float = 30.0) -> None:
        httpx.post(
            f"{self.url}/workers", json={"url": url}, headers=self.headers, timeout=10.0
        ).raise_for_status()
        self._wait(lambda: url in self.healthy_urls(), timeout, f"{url} to join the router")

    def remove_worker(self, url: str, timeout: float = 30.0) -> None:
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        for worker_id in ids:
            httpx.delete(
                f"{self.url}/workers/{worker_id}", headers=self.headers, timeout=10.0
            ).raise_for_status()
        self._wait(
            lambda: url not in {w["url"] for w in self.workers()},
            timeout,
            f"{url} to leave the router",
        )

    def quarantine(self, url: str) -> None:
        """Takes an engine out of rotation (e.g. it missed a weight push or was replaced)."""
        self.remove_worker(url)

    def readmit_if_current(self, url: str, version: int) -> bool:
        """Re-admits a quarantined engine only once it serves weight version `version`."""
        try:
            info = httpx.get(f"{url}/get_model_info", headers=self.headers, timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return False
        if str(info.get("weight_version")) != str(version):
            return False
        self.add_worker(url)
        return True

    @staticmethod
    def _wait(done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)
