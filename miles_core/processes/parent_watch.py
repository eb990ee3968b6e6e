"""Server subprocesses that do not outlive the process that started them.

`ManagedProcess.start` puts its own PID in the child's environment (`MILES_PARENT_PID`). Our
servers (`miles_core.engines.cpu.server`, `miles_core.sessions.server`) call `watch_parent` first: a
daemon thread polls whether that process is still alive and, once it is gone (a training process
killed with SIGKILL runs no cleanup), shuts the server down with SIGTERM, as `stop` would, and
after a grace period exits hard.

Why polling and not `prctl(PR_SET_PDEATHSIG)`: the death signal fires when the *thread* that
forked the child exits, not the process, and the runtime starts its servers from Prefect task
code that may run in a worker thread; a pipe would be inherited by every later fork of the
parent. A started-by-hand server (no variable set) is not watched.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from miles_core.processes.identity import ProcessIdentity

PARENT_ENV = "MILES_PARENT_PID"
POLL_S = 0.5
GRACE_S = 15.0


def parent_alive(pid: int, direct: bool, identity: ProcessIdentity | None = None) -> bool:
    """A direct child sees its parent die as a change of `getppid()` (it is re-parented to init
    or a subreaper), which a reused PID cannot fake; otherwise the process is probed by its
    identity (PID and start time, taken when the watch began), so a reused PID is not taken for
    the parent."""
    if direct:
        return os.getppid() == pid
    return identity is not None and identity.alive()


def watch_parent(
    on_gone: Callable[[], None] | None = None,
    poll_s: float = POLL_S,
    grace_s: float = GRACE_S,
) -> threading.Thread | None:
    """Starts the watcher when `MILES_PARENT_PID` is set; returns its thread (None otherwise).
    When the parent is gone: `on_gone()` (e.g. release files the parent owned), SIGTERM to this
    process (the server's own clean shutdown), and `os._exit(1)` if it still runs after
    `grace_s`."""
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return None
    pid = int(raw)
    direct = os.getppid() == pid
    identity = None if direct else ProcessIdentity.of(pid)

    def run() -> None:
        while parent_alive(pid, direct, identity):
            time.sleep(poll_s)
        print(
            f"parent process {pid} is gone: shutting down (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        if on_gone is not None:
            try:
                on_gone()
            except Exception as e:  # noqa: BLE001  (shutting down regardless)
                print(f"cleanup after parent {pid} failed: {e!r}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread
