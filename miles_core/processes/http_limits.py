"""Bounded requests for our HTTP servers: a body-size limit (ASGI middleware) and strict JSON.

`BodyLimit` refuses a body over its limit with 413 before the app reads it, whether the client
declared a Content-Length or streams it chunked (at most `limit` bytes are ever buffered).
`parse_json` is the one JSON reader of a route that must not store what it cannot give back:
NaN and ±Infinity (and numbers that overflow to them) are refused, and so is nesting deeper than
`max_depth` (a 50k-deep array would otherwise hit the interpreter's recursion limit in the
parser or, worse, later when a reply holding it is encoded)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response

MAX_BODY_BYTES = int(os.environ.get("MILES_MAX_BODY_BYTES", str(8 << 20)))
MAX_JSON_DEPTH = 64


class BadJson(ValueError):
    """A body that is not strict JSON, or nests too deeply (the message says which)."""


def engine_error(status: int, message: str) -> Response:
    """An error in the engine servers' shape (SGLang's `message`, OpenAI's `error.message`)."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message}, "success": False, "message": message},
    )


def add_engine_error_handlers(app) -> None:
    """An engine server's answers to a body its models refuse (400 naming the first field)
    and to a request the engine refuses (`EngineRequestError`: 400 with its reason)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError

    from miles_core.engines.wire import EngineRequestError

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", []))
        return engine_error(400, f"invalid request: {where}: {first.get('msg', 'malformed body')}")

    @app.exception_handler(EngineRequestError)
    async def engine_refused(_: Request, exc: EngineRequestError):
        return engine_error(400, str(exc))


class BodyLimit:
    """Refuses bodies over `limit` bytes with 413, whether they declare a Content-Length or come
    chunked: the body is read (at most `limit` bytes) before the app sees it. `respond(status,
    message)` builds the refusal in the server's own error shape."""

    def __init__(
        self,
        app,
        limit: int = MAX_BODY_BYTES,
        respond: Callable[[int, str], Response] = engine_error,
    ):
        self.app = app
        self.limit = limit
        self.respond = respond

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await self._send(scope, receive, send, 400, "malformed Content-Length")
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"request body of {size} bytes")
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(b"", receive, message), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(scope, receive, send, "a request body")
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope, receive, send, what: str) -> None:
        message = f"{what} exceeds the limit of {self.limit} bytes"
        await self._send(scope, receive, send, 413, message)

    async def _send(self, scope, receive, send, status: int, message: str) -> None:
        await self.respond(status, message)(scope, receive, send)


def _replay(body: bytes, receive, first=None):
    sent = False

    async def replay():
        nonlocal sent
        if first is not None and not sent:
            sent = True
            return first
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def parse_json(
    raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, empty: Any = None, what: str = "the body"
) -> Any:
    """The JSON value of a request body (`what` names it in messages), strictly: raises
    `BadJson` for one that is not JSON, holds NaN / Infinity (or a number that overflows to
    it), or nests deeper than `max_depth` arrays/objects. An empty body gives `empty`."""
    if not raw or not raw.strip():
        return empty

    def refuse_constant(name: str) -> float:
        raise BadJson(f"{what} holds {name}, not a JSON number (only finite numbers are accepted)")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise BadJson(
                f"{what} holds {text[:40]}, out of range (only finite numbers are accepted)"
            )
        return value

    _check_depth(raw, max_depth, what)  # before parsing: the parser itself recurses per level
    try:
        return json.loads(raw, parse_constant=refuse_constant, parse_float=finite_float)
    except BadJson:
        raise
    except RecursionError:  # unreachable after the depth check; kept as a last guard
        raise BadJson(f"{what} nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as e:
        raise BadJson(f"{what} is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, UnicodeDecodeError) as e:  # e.g. an integer of more than 4300 digits
        raise BadJson(f"{what} is not acceptable JSON ({e})"[:300]) from None


def _check_depth(raw: bytes | str, max_depth: int, what: str) -> None:
    """Refuses nesting deeper than `max_depth` without parsing: the bracket depth outside
    strings, at C speed (regex and numpy), so an 8 MiB body costs milliseconds."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return  # cannot nest deeper than the brackets it has
    skeleton = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    steps = np.frombuffer(skeleton, dtype=np.uint8)
    # [ and { open (+1), ] and } close (-1)
    depth = np.cumsum(np.where((steps == 0x5B) | (steps == 0x7B), 1, -1))
    if depth.size and int(depth.max()) > max_depth:
        raise BadJson(f"{what} nests deeper than {max_depth} levels")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
