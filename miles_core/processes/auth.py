"""Token authentication for every server of ours: a shared key, sent as `Authorization: Bearer
<key>` (the header an OpenAI client sends with its `api_key`), required on every route but
`/health` once a server has a key.

Server side: `--api-key` or the environment variable `MILES_API_KEY` (prefer the variable: a
command line shows in `ps`); `ports.bind_from_args` resolves it into `args.api_key` and refuses a
non-loopback address without one; `protect(app, key)` adds `BearerAuth` in front of the app.
Client side: `bearer(key)` is the header dict to send. A run (engines/fleet.py) starts its servers with
a key of its own (`run_key`): the configured `network.api_key`, else `MILES_API_KEY`, else a
random one per run, passed to children through the environment, never on their command line.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable

API_KEY_ENV = "MILES_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # liveness probes (supervisor, parents) carry no key

__all__ = [
    "API_KEY_ENV",
    "BearerAuth",
    "bearer",
    "env_key",
    "is_loopback",
    "new_key",
    "protect",
    "resolve_key",
    "run_key",
]


def new_key() -> str:
    """A random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def env_key() -> str | None:
    """`MILES_API_KEY` from the environment (None when unset or empty)."""
    return os.environ.get(API_KEY_ENV) or None


def resolve_key(given: str | None) -> str | None:
    """The key a server requires: `--api-key` if given, else `MILES_API_KEY`, else None."""
    return given or env_key()


def run_key(configured: str | None = None) -> str:
    """The key a run gives the servers it starts and its own clients: the configured one
    (`network.api_key`), else `MILES_API_KEY`, else a fresh random key for this run only."""
    return configured or env_key() or new_key()


def bearer(key: str | None) -> dict[str, str]:
    """The request headers that carry `key` ({} without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for every other address, including
    the wildcards 0.0.0.0 and :: (they serve every interface)."""
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


class BearerAuth:
    """ASGI middleware: 401 unless the request carries `Authorization: Bearer <key>` (compared
    in constant time); `open_paths` (default: /health) pass without one."""

    def __init__(self, app, key: str, open_paths: Iterable[str] = OPEN_PATHS):
        if not key:
            raise ValueError("BearerAuth needs a non-empty key")
        self.app = app
        self._expected = f"Bearer {key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        reason = "missing" if not given else "wrong"
        await _unauthorized(send, f"{reason} API key: send 'Authorization: Bearer <key>'")


async def _unauthorized(send, message: str) -> None:
    # the error shape of our servers: SGLang's `message` and OpenAI's `error.message`
    body = json.dumps(
        {
            "error": {"message": message, "type": "authentication_error"},
            "success": False,
            "message": message,
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def protect(app, key: str | None, open_paths: Iterable[str] = OPEN_PATHS):
    """`app` behind `BearerAuth` when `key` is set (outermost: nothing runs, no body is read,
    before the key is checked); `app` unchanged without a key."""
    if key:
        app.add_middleware(BearerAuth, key=key, open_paths=open_paths)
    return app
