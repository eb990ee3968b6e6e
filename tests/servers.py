"""A small HTTP peer of a test's own: an ASGI app served by uvicorn in a thread on 127.0.0.1
(a port the OS picks), stopped when the `with` block ends. For scripted engines and failing
services; the servers under test run as real subprocesses."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """Serves `app`; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once it listens
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def engine_client(model_dir, args: list[str], tmp_path_factory) -> Iterator:
    """An engine server subprocess of `model_dir` started with `args` (its log in a fresh temp
    folder, disk loads allowed under the session's temp root), and its HTTP client; stopped
    by PID at the end."""
    from miles_core.engines.http import EngineProcess, HttpEngine

    proc = EngineProcess(
        model_dir,
        args=args,
        log_path=tmp_path_factory.mktemp("eng") / "log.txt",
        weight_roots=[tmp_path_factory.getbasetemp()],  # every test's tmp_path: disk pushes
    )
    proc.start()
    client = HttpEngine(proc.url)
    try:
        yield client
    finally:
        client.close()
        proc.stop()
