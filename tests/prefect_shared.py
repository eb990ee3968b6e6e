"""One Prefect API server for every pytest worker of a test run (each costs ≈15 s and ≈10 CPU-s
to start), on an SQLite database in the run's shared folder. The controller starts it at
configure time when slow tests are selected, so it boots while the workers collect; otherwise
the first worker that asks starts it, under a file lock; the others read its record there. The pytest process that created the
folder (the xdist controller, or the only process without xdist) owns it: the server watches that
process (`MILES_PARENT_PID`, as a run's ephemeral server does) and `stop` ends it by PID.

A worker may finish before the others, so no worker stops the server; the owner does, in
`pytest_unconfigure`, after every worker is done.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from infra.processes import ProcessRecord, spawn, stop_group, wait_healthy

SHARED_ENV = "MILES_TEST_SHARED_DIR"
OWNER_ENV = "MILES_TEST_OWNER_PID"
NAME = "prefect-server"


def create_shared_dir(start_server: bool) -> None:
    """In the owner, before any worker starts: the folder and the owner's PID, in the
    environment the workers inherit; with `start_server`, the server starts now and boots
    while the workers collect (≈15–45 s that the first test using it would otherwise wait)."""
    if SHARED_ENV in os.environ:
        return
    os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="miles-tests-")
    os.environ[OWNER_ENV] = str(os.getpid())
    if start_server:
        with _locked() as saved:
            _spawn(saved)


def api_url(startup_timeout_s: float = 120) -> str:
    """The shared server's API URL once it answers, started here if nobody has yet."""
    with _locked() as saved:  # the other workers wait here while it starts
        record = ProcessRecord.load(saved) if saved.exists() else _spawn(saved)
        try:
            wait_healthy([record], startup_timeout_s)
        except Exception:
            stop_group(record)
            saved.unlink()
            raise
        return record.url


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    """The shared folder's lock held; yields the path of the server's record."""
    shared = Path(os.environ[SHARED_ENV])
    with open(shared / "prefect.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield shared / f"{NAME}.json"


def _spawn(saved: Path) -> ProcessRecord:
    """Starts the server in its own session (it outlives the worker that started it; the owner
    stops it) and saves its record."""
    from flows.prefect_server import server_command, server_env
    from miles_core.processes.ports import free_port

    shared = saved.parent
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = server_env(
        int(os.environ[OWNER_ENV]),
        PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{shared}/prefect.db",
    )
    env.pop("PREFECT_API_URL", None)
    record = spawn(
        NAME, server_command(port), env, port, url, f"{url}/health", shared / f"{NAME}.log"
    )
    record.save(shared)
    return record


def stop() -> None:
    """In the owner, after every worker: stops the server's process group and removes the
    folder."""
    if os.environ.get(OWNER_ENV) != str(os.getpid()):
        return
    shared = Path(os.environ.pop(SHARED_ENV))
    os.environ.pop(OWNER_ENV)
    saved = shared / f"{NAME}.json"
    if saved.exists():
        stop_group(ProcessRecord.load(saved))
    shutil.rmtree(shared, ignore_errors=True)
