"""A server subprocess on 127.0.0.1: started with a command, healthy when an HTTP endpoint answers
200, stopped by PID (SIGTERM, then SIGKILL, its descendants too). Engines, the session server, the
evaluation service, the router and SGLang servers use it.

Port: a server of ours (`reports_port = True`) binds its own socket and writes the port it got to
a file the parent names (`--port-file`, miles_core/processes/ports.py), so two servers started at once
never race for one port; `port_range` keeps it inside a range the user allows. Once known, the
port stays: a restart (engines/supervisor.py) passes it explicitly, so every client's URL stays
valid. For a program that cannot report its port the parent probes a free one (`free_port`).

Key: with `api_key` the child gets it in its environment (`MILES_API_KEY`, processes/auth.py: never
on a command line of ours, which `ps` shows) and requires it on every route but `/health`;
`headers` is what a client of the process sends. Without one, an inherited MILES_API_KEY is
removed from the child's environment: the child requires exactly the key its parent knows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

# ProcessUnavailable lives beside the engine protocol, so weights/ catches it without rollout/
from miles_core.engines.protocol import ProcessUnavailable  # noqa: F401  (re-exported)
from miles_core.processes.auth import API_KEY_ENV, bearer
from miles_core.processes.identity import children, terminate
from miles_core.processes.parent_watch import PARENT_ENV
from miles_core.processes.ports import PortRange, free_port, read_port_file

# HTTP keep-alive of our servers: longer than any client's pooled idle time. uvicorn's 5 s
# default closes idle connections while a client may be reusing one (ReadError at the client).
KEEP_ALIVE_S = 120


__all__ = ["KEEP_ALIVE_S", "ManagedProcess", "ProcessUnavailable", "free_port"]


class ManagedProcess:
    health_path = "/health"
    health_poll_s = 0.2
    what = "server"
    # True: the command binds its own port and writes it to `--port-file` (see `port_args`)
    reports_port = False

    def __init__(
        self,
        port: int | None = None,
        log_path: str | Path | None = None,
        host: str = "127.0.0.1",
        port_range: PortRange | str | None = None,
        api_key: str | None = None,
    ):
        self.host = host
        self.api_key = api_key or None
        self.port_range = PortRange.parse(port_range) if port_range else None
        if not port and not self.reports_port:
            port = free_port(host, self.port_range)
        self.port: int | None = port or None
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._port_file: Path | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def port_args(self) -> list[str]:
        """`--port N` once the port is known (a restart keeps it), else `--port 0` (or the
        range) and the file the server reports its port to."""
        if self.port:
            return ["--port", str(self.port)]
        if self._port_file is None:
            raise RuntimeError(f"{self.what}: port_args() outside start()")
        args = ["--port", "0", "--port-file", str(self._port_file)]
        if self.port_range is not None:
            args += ["--port-range", str(self.port_range)]
        return args

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError(f"the {self.what}'s port is known once start() has returned")
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The headers a client of this process sends (its key, if it has one)."""
        return bearer(self.api_key)

    def child_env(self) -> dict[str, str]:
        """The child's environment: ours, its parent's PID, and its key (or none)."""
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 120.0):
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # our servers exit when this process dies, even by SIGKILL (processes/parent_watch.py)
        env = self.child_env()
        tmp = None
        if not self.port:
            tmp = Path(tempfile.mkdtemp(prefix="miles-port-"))
            self._port_file = tmp / "port"
        try:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env
            )
            self._wait_healthy(timeout)
        except BaseException:  # interrupted or failed start-up: the child does not stay behind
            self.stop()
            raise
        finally:
            self._port_file = None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own descriptor
        return self

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessUnavailable(
                    f"{self.what} process {self.pid} exited with code {self.proc.returncode} "
                    f"during start-up{self._log_tail()}"
                )
            if not self.port:
                assert self._port_file is not None
                self.port = read_port_file(self._port_file)
            if self.port:
                try:
                    r = httpx.get(
                        f"{self.url}{self.health_path}",
                        headers=self.headers,  # /health is open; another probe may not be
                        timeout=max(2.0, self.health_poll_s),
                    )
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(self.health_poll_s)
        where = self.url if self.port else "(no port reported)"
        self.stop()
        raise ProcessUnavailable(f"{self.what} at {where} not healthy after {timeout:.0f} s")

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines of the log, for an error message (the log may live in a run folder
        that is removed when the run fails)."""
        if not self.log_path:
            return ""
        try:
            text = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f"; last lines of {self.log_path}:\n" + "\n".join(text[-lines:]) if text else ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, SIGKILL after `timeout`; then the same for any process it started that is
        still running (an SGLang server's schedulers, say)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        left = children(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        if left:
            terminate(left, timeout)

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
