"""Engine servers started by Ray actors, one actor per engine on the first bundle of its GPUs.

The actor starts the server (a `ManagedProcess`: our engine server, SGLang) as its own child:
the server runs on the actor's node, and exits when the actor dies (processes/parent_watch.py).
The driver holds a `PlacedProcess`, which the engine supervisor watches like a local process:
an actor that died reads as an exited process, and `start()` places a new actor on the same
bundle, which restarts the server on the same port.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

EXITED = -9  # what `poll()` reads when the actor holding the server is gone


class EngineHost:
    """The actor holding one engine server (wrapped by `ray.remote` where it is placed)."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self.process: Any = None

    def start(self, process: Any, timeout: float) -> tuple[int, int]:
        self.process = process.start(timeout=timeout)
        return process.port, process.pid

    def poll(self) -> int | None:
        return self.process.proc.poll() if self.process is not None else EXITED

    def kill(self) -> None:
        if self.process is not None and self.process.proc.poll() is None:
            self.process.proc.kill()
            self.process.proc.wait(30)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class RemoteProc:
    """`subprocess.Popen`'s calls the supervisor makes, answered by one actor (a replacement
    has a `RemoteProc` of its own: this one keeps reading as exited)."""

    def __init__(self, actor: Any, pid: int):
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None

    def _ask(self, method: str, dead: Any) -> Any:
        import ray

        if self.actor is None:
            return dead
        try:
            return ray.get(getattr(self.actor, method).remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return dead

    def poll(self) -> int | None:
        self.returncode = self._ask("poll", EXITED)
        return self.returncode

    def kill(self) -> None:
        self._ask("kill", None)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()

    def release(self) -> None:
        """Stops the server and ends the actor."""
        import ray

        if self.actor is not None:
            self._ask("stop", None)
            ray.kill(self.actor)
            self.actor = None


class PlacedProcess:
    """An engine server behind an actor that `spawn()` places. `launch()` starts it without
    waiting (several engines start at once); the first use of its URL, PID or process waits
    until it serves. `start()` (the supervisor's, for a replacement) waits at once."""

    def __init__(self, process: Any, spawn: Callable[[], Any]):
        self._process = process
        self._spawn = spawn
        self._pending: tuple[Any, Any, float] | None = None  # (actor, its start, timeout)
        self._pid: int | None = None
        self._proc: RemoteProc | None = None

    def launch(self, timeout: float = 120.0) -> PlacedProcess:
        self.stop()
        actor = self._spawn()
        self._pending = (actor, actor.start.remote(self._process, timeout), timeout)
        return self

    def _settle(self) -> None:
        import ray

        if self._pending is None:
            return
        actor, started, timeout = self._pending
        self._pending = None
        try:
            port, self._pid = ray.get(started, timeout=timeout + 30)
        except BaseException:
            ray.kill(actor)
            raise
        self._process.port = port  # a replacement keeps the URL every client has
        self._proc = RemoteProc(actor, self._pid)

    def start(self, timeout: float = 120.0) -> PlacedProcess:
        """A new actor on the engine's bundle starts the server (on the port it had, if it
        ran before); returns once it serves."""
        self.launch(timeout)
        self._settle()
        return self

    @property
    def pid(self) -> int | None:
        self._settle()
        return self._pid

    @property
    def proc(self) -> RemoteProc | None:
        self._settle()
        return self._proc

    @property
    def port(self) -> int | None:
        self._settle()
        return self._process.port

    @property
    def url(self) -> str:
        self._settle()
        return self._process.url

    @property
    def headers(self) -> dict[str, str]:
        return self._process.headers

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        if self._pending is not None:
            ray.kill(self._pending[0])
            self._pending = None
        if self._proc is not None:
            self._proc.release()
