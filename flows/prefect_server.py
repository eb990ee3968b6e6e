"""The ephemeral Prefect API server of a CLI run, which stops with the run, also after `kill -9`.

Without `PREFECT_API_URL`, Prefect starts a temporary API server on first use
(`prefect.server.api.server.SubprocessASGIServer`: `python -m uvicorn ... create_app`) and stops
it at exit (`atexit`). A run killed with SIGKILL runs no `atexit`: the server was re-parented to
PID 1 and stayed (≈230 MB). `WatchedEphemeralServer` (`server_class()`) is that same server started through
`python -m flows.prefect_server <uvicorn args>`, which first starts the parent-death watch of our
own servers (`miles_core/proc/parent_watch.py`, `MILES_PARENT_PID`): once the run's process is
gone, the server shuts down (SIGTERM to itself, a hard exit after the grace period).

`install()` registers it as the process's default ephemeral server (the instance Prefect's
clients find, `SubprocessASGIServer()`), so nothing else about how a flow reaches its API
changes. The command is Prefect's own (3.x `_run_uvicorn_command`), with our module in front.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any

from miles_core.proc.parent_watch import PARENT_ENV


def server_command(port: int) -> list[str]:
    """The argv of a watched Prefect API server on 127.0.0.1:`port`: Prefect's own uvicorn
    command (3.x `SubprocessASGIServer._run_uvicorn_command`), with this module in front."""
    import prefect

    return [
        sys.executable,
        "-m",
        "flows.prefect_server",
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


def server_env(watched_pid: int, **settings: str) -> dict[str, str]:
    """The environment of `server_command`: this process's, Prefect's settings in effect, the
    ephemeral-server switches (no UI) and the watch on `watched_pid`, whose exit stops it."""
    from prefect.settings import get_current_settings

    return {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
        **settings,
        PARENT_ENV: str(watched_pid),
    }


@functools.cache
def server_class() -> type:
    """`WatchedEphemeralServer`, defined on first use: `prefect.server.api.server` is a heavy
    import a run against a Prefect server of its own never needs."""
    from prefect.server.api.server import SubprocessASGIServer

    class WatchedEphemeralServer(SubprocessASGIServer):
        """Prefect's ephemeral API server, run under the parent-death watch."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # the watch: this process is the run
            return subprocess.Popen(server_command(self.port), env=server_env(os.getpid()))

    return WatchedEphemeralServer


def install() -> Any | None:
    """Makes the watched server the one Prefect starts on first use, when this process would
    start an ephemeral server at all (no `PREFECT_API_URL`, ephemeral mode on) and none is
    registered yet; returns it (None: Prefect's API is elsewhere, or another one is there)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    cls = server_class()
    existing = cls._instances.get(None)  # SubprocessASGIServer's registry of instances
    if existing is not None:
        return existing if isinstance(existing, cls) else None
    return cls()


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.prefect_server <uvicorn options>`: uvicorn, with the parent watch."""
    from miles_core.proc.parent_watch import watch_parent

    watch_parent()
    import uvicorn

    uvicorn.main.main(args=sys.argv[1:] if argv is None else argv, prog_name="uvicorn")


if __name__ == "__main__":
    main()
