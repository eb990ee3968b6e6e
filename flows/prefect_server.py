"""The Prefect API a CLI run reports to: the one `PREFECT_API_URL` names, else this user's local
server, kept between runs.

Without an API URL, Prefect would start a temporary server inside every run (10–25 s of start-up
on two cores, and the UI gone with the run). Instead, the first run that needs one starts a
Prefect server for its `PREFECT_HOME` on 127.0.0.1, detached, serving the API and the UI; later
runs find its record (`$PREFECT_HOME/miles-api/prefect-server.json`) and reuse it while it lives.
It stops itself once no run has used it for `MILES_PREFECT_IDLE_S` seconds (default 600): every
run registers its PID in `miles-api/clients/` while it lasts (a run killed with SIGKILL counts as
gone once its PID does), and any HTTP request (the UI open in a browser) counts as use.

The run starts the server before its heavy imports and waits for it just before its first flow
(`LocalApi.wait_ready`), so the server boots while the run imports torch and checks its inputs.
Before the run exits, its queued log lines and events are sent (`drain_to_api`): otherwise
Prefect's exit hook retries them against an API that is gone, and the last lines are lost.

`server_command` / `server_env` also start the tests' shared server (tests/prefect_shared.py),
which watches its owner instead (`MILES_PARENT_PID`, miles_core/processes/parent_watch.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from miles_core.processes.parent_watch import PARENT_ENV

NAME = "prefect-server"
KEPT_DIR = "miles-api"  # under PREFECT_HOME
IDLE_ENV = "MILES_PREFECT_IDLE_S"
DEFAULT_IDLE_S = 600.0
_KEPT_ENV = "MILES_PREFECT_KEPT_DIR"  # set in a kept server's environment: its folder
_POLL_S = 1.0
_GRACE_S = 15.0


def server_command(port: int, factory: str = "prefect.server.api.server:create_app") -> list[str]:
    """The argv of a Prefect API server on 127.0.0.1:`port` started through this module: Prefect's
    own uvicorn command (3.x `SubprocessASGIServer._run_uvicorn_command`), with `main` in front."""
    import prefect

    return [
        sys.executable,
        "-m",
        "flows.prefect_server",
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        factory,
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
    """The environment of an ephemeral `server_command` (no UI, Prefect's ephemeral set of
    services) that stops when `watched_pid` exits."""
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


# ----------------------------------------------------------------------------- the run's side
@dataclass
class LocalApi:
    """This run's use of the kept local server: its record, and the run's registration."""

    record: object  # infra.processes.ProcessRecord
    started_here: bool
    client_file: Path
    folder: Path

    @property
    def ui_url(self) -> str:
        return self.record.url.removesuffix("/api")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the server answers; one that died during start-up (a port taken meanwhile) is
        replaced once."""
        from infra.processes import ServiceError, wait_healthy

        try:
            wait_healthy([self.record], timeout_s)
        except ServiceError:
            if not self.started_here:
                raise
            self.release()
            fresh = local_api(restart=True)
            self.__dict__.update(fresh.__dict__)
            wait_healthy([self.record], timeout_s)

    def release(self, unused: bool = False) -> None:
        """The run no longer uses the server (its idle time starts now). `unused`: the command
        ended before its first flow (refused inputs): a server it started stops now, unless
        another run uses it by then. It is told to stop (SIGTERM), not waited for: a server still
        starting finishes its start-up (database migrations) first, then exits."""
        self.client_file.unlink(missing_ok=True)
        if not (unused and self.started_here):
            return
        from infra.processes import record_alive

        with _locked(self.folder):
            if _live_clients(self.folder):
                return
            _forget(self.folder, self.record.pid)
        if record_alive(self.record):
            os.kill(self.record.pid, signal.SIGTERM)


def prefect_home() -> Path:
    """PREFECT_HOME as Prefect resolves it (its settings: environment, profile, default)."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser()


def api_configured() -> bool:
    """A Prefect API is set for this process (environment or active profile)."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def use_local_api() -> LocalApi | None:
    """For a CLI run about to start flows: None when an API is configured; otherwise the kept
    local server (started now if none runs), its URL put in `PREFECT_API_URL` for this process
    and its children."""
    if api_configured():
        return None
    api = local_api()
    os.environ["PREFECT_API_URL"] = api.record.url
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # Prefect read its settings when it was imported
    return api


def local_api(restart: bool = False) -> LocalApi:
    """Registers this process as a client of the kept server of this PREFECT_HOME, starting one
    when none runs (or with `restart`), all under the folder's lock (the server checks for
    clients under the same lock before it stops)."""
    from infra.processes import ProcessRecord, record_alive

    folder = prefect_home() / KEPT_DIR
    with _locked(folder):
        client = _register(folder)
        saved = folder / f"{NAME}.json"
        record = None
        if saved.exists() and not restart:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                record = ProcessRecord.load(saved)
        if record is not None and record_alive(record) and _same_environment(record.command[0]):
            return LocalApi(record, False, client, folder)
        record = _spawn(folder)
        record.save(folder)
        return LocalApi(record, True, client, folder)


def _same_environment(executable: str) -> bool:
    """The recorded server runs this process's Python environment (the same bin folder: `python`
    and `python3` of one venv are one environment, two venvs' may hold other Prefect versions)."""
    return Path(executable).parent == Path(sys.executable).parent


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _register(folder: Path) -> Path:
    from miles_core.processes.identity import ProcessIdentity

    me = ProcessIdentity.of(os.getpid())
    clients = folder / "clients"
    clients.mkdir(exist_ok=True)
    path = clients / str(me.pid)
    path.write_text(repr(me.create_time))
    return path


def _spawn(folder: Path):
    from infra.processes import spawn
    from miles_core.processes.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", PARENT_ENV)} | {
        "PREFECT_HOME": str(folder.parent),
        _KEPT_ENV: str(folder),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the UI asks the API at this address (its default is port 4200's: "Can't connect")
        "PREFECT_UI_API_URL": url,
    }
    command = server_command(port, factory="flows.prefect_server:kept_app")
    return spawn(NAME, command, env, port, url, f"{url}/health", folder / f"{NAME}.log")


def send_to_api(logger_name: str = "miles") -> None:
    """The lines of `logger_name` logged inside a flow run (the run's step lines), INFO and up,
    also go to the Prefect API, shown with the flow run's own logs in the UI; lines logged
    outside any flow run (a thread of an engine server, a refusal before the flow) stay local."""
    from prefect.exceptions import MissingContextError
    from prefect.logging.handlers import APILogHandler

    class RunLogHandler(APILogHandler):
        def handleError(self, record: logging.LogRecord) -> None:
            if not isinstance(sys.exc_info()[1], MissingContextError):
                super().handleError(record)

    logger = logging.getLogger(logger_name)
    if logger.level == logging.NOTSET:  # a deployment's runner sets the root to WARNING
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        logger.addHandler(RunLogHandler())


def _saved_record(folder: Path):
    from infra.processes import ProcessRecord, record_alive

    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        record = ProcessRecord.load(folder / f"{NAME}.json")
        if record_alive(record):
            return record
    return None


def local_status(home: Path | None = None) -> str:
    """`miles prefect status`: the kept server of `home` (default: this PREFECT_HOME), if one
    runs."""
    home = home or prefect_home()
    record = _saved_record(home / KEPT_DIR)
    if record is None:
        return f"no local Prefect server runs for {home}"
    live = _live_clients(home / KEPT_DIR)
    return f"Prefect UI: {record.url.removesuffix('/api')} (pid {record.pid}, {live} runs using it)"


def stop_local(home: Path | None = None) -> str:
    """`miles prefect stop`: stops the kept server of `home` (default: this PREFECT_HOME) now;
    runs using it lose their API."""
    from infra.processes import stop_group

    home = home or prefect_home()
    record = _saved_record(home / KEPT_DIR)
    if record is None:
        return f"no local Prefect server runs for {home}"
    with _locked(home / KEPT_DIR):
        _forget(home / KEPT_DIR, record.pid)
    return f"Prefect server (pid {record.pid}): {stop_group(record)}"


def drain_to_api(timeout_s: float = 30.0) -> None:
    """Sends the log lines and events this process has queued for the Prefect API and stops
    their workers, while the API still answers (a flow run's last lines included)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


# ------------------------------------------------------------------------ the kept server's side
_last_request = [time.monotonic()]


def kept_app():
    """The ASGI app of a kept server: Prefect's, every request noted as use."""
    from prefect.server.api.server import create_app

    app = create_app()

    async def noted(scope, receive, send):
        if scope["type"] != "lifespan":
            _last_request[0] = time.monotonic()
        await app(scope, receive, send)

    return noted


def _live_clients(folder: Path) -> int:
    """Registered runs still running; the registrations of runs that are gone are removed."""
    from miles_core.processes.identity import ProcessIdentity

    live = 0
    for path in (folder / "clients").glob("*"):
        try:
            identity = ProcessIdentity(int(path.name), float(path.read_text()))
        except (ValueError, OSError):
            identity = None
        if identity is not None and identity.alive():
            live += 1
        else:
            path.unlink(missing_ok=True)
    return live


def _forget(folder: Path, pid: int) -> None:
    """Removes the server record if it is `pid`'s (a later server's record stays)."""
    from infra.processes import ProcessRecord

    saved = folder / f"{NAME}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if ProcessRecord.load(saved).pid == pid:
            saved.unlink()


def _idle_watch(folder: Path, idle_s: float) -> None:
    """Stops this kept server once no run has used it for `idle_s`: under the folder's lock (a
    run registering now either comes first and keeps it, or finds no record and starts another),
    the record is removed, then SIGTERM (uvicorn's clean shutdown), a hard exit after a grace."""
    last_client = time.monotonic()
    while True:
        time.sleep(_POLL_S)
        with _locked(folder):
            if _live_clients(folder):
                last_client = time.monotonic()
            if time.monotonic() - max(last_client, _last_request[0]) < idle_s:
                continue
            _forget(folder, os.getpid())
        print(f"idle for {idle_s:.0f} s: stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_GRACE_S)
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.prefect_server <uvicorn options>`: uvicorn, under the parent watch (an
    ephemeral server) or the idle watch (a kept one)."""
    from miles_core.processes.parent_watch import watch_parent

    watch_parent()
    kept = os.environ.get(_KEPT_ENV)
    if kept:
        idle_s = float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
        threading.Thread(
            target=_idle_watch, args=(Path(kept), idle_s), name="idle-watch", daemon=True
        ).start()
    import uvicorn

    uvicorn.main.main(args=sys.argv[1:] if argv is None else argv, prog_name="uvicorn")


if __name__ == "__main__":
    main()
