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
