"""What transports to engine servers share: the client type they need, and pausing every
engine around a load so that an unreachable engine fails the push before anything changed."""

from __future__ import annotations

import contextlib
from typing import Protocol

import httpx

from miles_core.rollout.process import ProcessUnavailable


class RemoteEngine(Protocol):
    url: str

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...


def require_remote(engines: list, transport: str) -> list:
    for e in engines:
        if not hasattr(e, "url"):
            raise ValueError(
                f"weight transport {transport!r} pushes to engine servers "
                "(rollout.engine: server); this engine runs in the trainer's process — use "
                "transport 'colocated'"
            )
    return list(engines)


class PushFailed(RuntimeError):
    """A push could not reach an engine; engines keep their previous weights and version."""


@contextlib.contextmanager
def paused(engines: list, mode: str, skip: bool = False):
    """Pauses every engine (failing before any load if one cannot be reached), then continues
    them all, also when the load fails. With `skip`, only checks that every engine answers."""
    if skip:
        check_reachable(engines)
        yield
        return
    done = []
    try:
        for e in engines:
            e.pause(mode)
            done.append(e)
    except (ProcessUnavailable, OSError, ValueError) as err:  # ValueError: request rejected
        _resume(done)
        raise PushFailed(
            f"weight push aborted: engine at {e.url} cannot be reached ({err}); no engine "
            "loaded anything"
        ) from err
    try:
        yield
    finally:
        _resume(done)


def check_reachable(engines: list) -> None:
    """Fails the push before anything is loaded if any engine does not answer."""
    for e in engines:
        try:
            e.server_info()
        except (ProcessUnavailable, OSError, httpx.HTTPError) as err:
            raise PushFailed(
                f"weight push aborted: engine at {e.url} cannot be reached ({err!r}); no engine "
                "loaded anything"
            ) from err


def _resume(engines: list) -> None:
    for e in engines:
        with contextlib.suppress(ProcessUnavailable, OSError, ValueError):
            e.resume()
