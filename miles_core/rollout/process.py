"""A server subprocess on 127.0.0.1: started with a command, healthy when an HTTP endpoint answers
200, stopped by PID (SIGTERM, then SIGKILL). Engines, the router and SGLang servers use it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

from miles_core.rollout.parent_watch import PARENT_ENV

# HTTP keep-alive of our servers: longer than any client's pooled idle time. uvicorn's 5 s
# default closes idle connections while a client may be reusing one (ReadError at the client).
KEEP_ALIVE_S = 120


class ProcessUnavailable(RuntimeError):
    """The process died, hangs, or cannot be reached."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    health_path = "/health"
    health_poll_s = 0.2
    what = "server"

    def __init__(
        self, port: int | None = None, log_path: str | Path | None = None, host: str = "127.0.0.1"
    ):
        self.host = host
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 120.0):
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # our servers exit when this process dies, even by SIGKILL (rollout/parent_watch.py)
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessUnavailable(
                    f"{self.what} process {self.pid} exited with code {self.proc.returncode} during start-up"
                )
            try:
                if (
                    httpx.get(
                        f"{self.url}{self.health_path}", timeout=max(2.0, self.health_poll_s)
                    ).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(self.health_poll_s)
        self.stop()
        raise ProcessUnavailable(f"{self.what} at {self.url} not healthy after {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
