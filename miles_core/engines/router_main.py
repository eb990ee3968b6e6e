"""sglang-router as `RouterProcess` starts it: `python -m miles_core.engines.router_main launch …`
(sglang-router's own arguments).

- Its API key comes from the environment (`MILES_API_KEY`, which only its user can read) and is
  handed to the router inside this process, never on a command line (`/proc/<pid>/cmdline` is
  readable by every local user), `=`-joined (a key may start with "-").
- It exits with the process that started it, as our servers do (`processes/parent_watch.py`). The
  router runs in this process's main thread without releasing the GIL, so a watcher thread here
  would never run: a forked watcher process polls the starter and, once it is gone, stops the
  router with SIGTERM (SIGKILL after the grace period); it exits itself when the router does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from miles_core.processes.auth import API_KEY_ENV
from miles_core.processes.identity import ProcessIdentity, pid_alive
from miles_core.processes.parent_watch import GRACE_S, PARENT_ENV, POLL_S


def _watch_starter() -> None:
    """Forks the watcher (when `MILES_PARENT_PID` is set); returns in the router's process."""
    raw = os.environ.get(PARENT_ENV)
    starter = ProcessIdentity.of(int(raw)) if raw else None
    if starter is None:
        return
    router = os.getpid()
    if os.fork():
        return
    try:  # the watcher: nothing but polling
        while os.getppid() == router and starter.alive():
            time.sleep(POLL_S)
        if os.getppid() == router:  # the starter is gone, the router is not
            print(f"parent process {raw} is gone: stopping the router", file=sys.stderr)
            os.kill(router, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
            while pid_alive(router) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if pid_alive(router):
                os.kill(router, signal.SIGKILL)
    finally:
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    from sglang_router.cli import main as router_main

    argv = list(sys.argv[1:] if argv is None else argv)
    key = os.environ.get(API_KEY_ENV)
    if key:
        argv.append(f"--api-key={key}")
    _watch_starter()
    router_main(argv)


if __name__ == "__main__":
    main()
