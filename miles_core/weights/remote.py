"""What transports to engine servers share: pausing every engine around a load so that an
unreachable engine fails the push before anything changed, and the reachability check."""

from __future__ import annotations

import contextlib

import httpx

from miles_core.engines.protocol import PAUSED_PUSH, ProcessUnavailable


class PushFailed(RuntimeError):
    """A push could not reach an engine; engines keep their previous weights and version."""


@contextlib.contextmanager
def paused(engines: list, mode: str, skip: bool = False, check: bool = True):
    """Pauses every engine (failing before any load if one cannot be reached), then continues
    them all, also when the load fails. With `skip`, only checks that every engine answers (and
    not even that without `check`: an engine that pauses itself in the load call, `one_call`)."""
    if skip:
        if check:
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


def one_call(engines: list) -> bool:
    """One engine that pauses and continues itself within its weight calls (`pause_mode` in the
    body, engines/protocol.py: PAUSED_PUSH): a push needs no separate pause and continue calls. With
    several engines every one is paused first, so that an unreachable one fails the push before
    any engine loads."""
    return len(engines) == 1 and PAUSED_PUSH in getattr(engines[0], "weight_routes", ())


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
