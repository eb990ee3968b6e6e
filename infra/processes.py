"""Detached server processes recorded on disk: start one in its own process group, tell whether a
recorded PID is still that process (not a reused PID, not a zombie), stop its whole group.

A record is a JSON file `<dir>/<name>.json` holding the PID, the process's start time
(`psutil.Process.create_time()`, so a PID reused by the kernel for another program is not
mistaken for ours), its port, URL, health URL and log path. PID identity, descendants and process
groups come from `miles_core/processes/identity.py` (psutil), the one implementation the runtime's
servers use too; the names tests and ui-check import are re-exported here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from miles_core.processes.identity import (
    ProcessIdentity,
    descendants,
    group_members,
    kill_pids,
    pid_alive,
    start_time,
)

__all__ = [
    "ProcessRecord",
    "ServiceError",
    "api_call",
    "descendants",
    "group_members",
    "healthy",
    "pid_alive",
    "port_free",
    "record_alive",
    "spawn",
    "start_time",
    "stop_group",
    "stop_serving_process",
    "tail",
    "wait_for",
    "wait_healthy",
]


class ServiceError(RuntimeError):
    """A service could not be started or stopped; the message says which and why."""


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    create_time: float  # the process's start time: a reused PID does not match
    port: int
    url: str
    health_url: str
    log: str
    command: list[str]

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.rename(path)
        return path

    @classmethod
    def load(cls, path: Path) -> ProcessRecord:
        data = json.loads(path.read_text())
        if "start_ticks" in data:  # written before psutil: clock ticks after boot
            ticks = data.pop("start_ticks")
            data["create_time"] = psutil.boot_time() + ticks / os.sysconf("SC_CLK_TCK")
        return cls(**data)

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.create_time)


def record_alive(record: ProcessRecord) -> bool:
    """The recorded process itself still runs (not a zombie, not another program on its PID)."""
    return record.identity.alive()


def wait_for(check, timeout: float, what: str, poll: float = 0.5):
    """Polls `check` until it returns something truthy (returned); TimeoutError naming `what`
    once `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def api_call(method: str, url: str, timeout_s: float = 60.0, **kwargs) -> httpx.Response:
    """One HTTP call to a server of the stack, repeated while it answers 503 or cannot be
    reached (the Prefect server answers 503 while its SQLite database is busy) for up to
    `timeout_s`; any other answer is returned as it is."""
    from tenacity import (
        retry,
        retry_if_exception_type,
        retry_if_result,
        stop_after_delay,
        wait_exponential,
    )

    call = retry(
        retry=retry_if_result(lambda r: r.status_code == 503)
        | retry_if_exception_type(httpx.TransportError),
        stop=stop_after_delay(timeout_s),
        wait=wait_exponential(multiplier=0.2, max=3),
        retry_error_callback=lambda state: state.outcome.result(),  # the last answer or error
    )(httpx.request)
    return call(method, url, timeout=kwargs.pop("timeout", 30), **kwargs)


def stop_serving_process(proc: subprocess.Popen, seen: set[int]) -> None:
    """Stops a process started in its own session (e.g. `deployments/serve.py`): SIGTERM to its
    group, SIGKILL after 30 s; then every PID in `seen` (its descendants so far, plus the ones
    found now) still alive is killed (flow runs live in sessions of their own)."""
    seen.update(descendants(proc.pid))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    kill_pids(seen)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def spawn(
    name: str,
    command: list[str],
    env: dict[str, str],
    port: int,
    url: str,
    health_url: str,
    log: Path,
    cwd: Path | None = None,
) -> ProcessRecord:
    """Start `command` detached in a new session (its own process group), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    started = start_time(proc.pid)
    if started is None:
        raise ServiceError(f"{name} exited at once ({' '.join(command)}); see {log}")
    return ProcessRecord(name, proc.pid, started, port, url, health_url, str(log), command)


def wait_healthy(records: list[ProcessRecord], timeout: float) -> dict[str, float]:
    """Poll every record's health URL until all answer 200; return seconds to healthy per name.
    Raises ServiceError naming the service (and its log) that died or stayed unhealthy."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    pending = {r.name: r for r in records}
    took: dict[str, float] = {}
    while pending:
        for name, record in list(pending.items()):
            if not record_alive(record):
                raise ServiceError(
                    f"{name} (pid {record.pid}) exited during start-up; last log lines:\n"
                    + tail(Path(record.log))
                )
            if healthy(record.health_url):
                took[name] = time.monotonic() - t0
                del pending[name]
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{n} ({r.health_url}, log {r.log})" for n, r in pending.items())
            raise ServiceError(f"not healthy after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.25)
    return took


def stop_group(record: ProcessRecord, timeout: float = 20.0) -> str:
    """SIGTERM the record's process group, SIGKILL what is left after `timeout`. Returns what
    happened ("stopped", "killed", "not running")."""
    if not record_alive(record):
        if pid_alive(record.pid):  # the PID now belongs to another program: not ours to stop
            return "not running"
        if not group_members(record.pid):  # leader gone; children of its group may remain
            return "not running"
    _signal_group(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_members(record.pid):
            return "stopped"
        time.sleep(0.1)
    _signal_group(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_members(record.pid):
        if time.monotonic() > deadline:
            raise ServiceError(
                f"{record.name}: processes {group_members(record.pid)} survive SIGKILL"
            )
        time.sleep(0.1)
    return "killed"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"
