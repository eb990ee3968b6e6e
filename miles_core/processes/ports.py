"""Ports without a choose-then-bind race: a server binds its own socket (port 0, or the first free
port of a range the user allows) and reports the port it got; its parent learns the port from
that report instead of picking one that something else may take first.

Server side (`add_port_arguments`, `bind_from_args`): `--port N` (0 = any), `--port-range LO-HI`,
`--port-file PATH` (the bound port is written there, atomically, before the server loads
anything), `--api-key` (or MILES_API_KEY: processes/auth.py; an address other than loopback is refused
without a key). Parent side: `ManagedProcess` (processes/managed.py) passes a port file and reads it.
For programs that cannot report their port (sglang-router, SGLang, torchrun) `free_port` probes
one, within the range when one is set; only there does the race remain.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path


class NoFreePort(OSError):
    """No port of the allowed range could be bound."""


@dataclass(frozen=True)
class PortRange:
    """Ports `low`..`high`, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= 65535:
            raise ValueError(f"port range {self.low}-{self.high}: need 1 <= low <= high <= 65535")

    @classmethod
    def parse(cls, text: str | PortRange) -> PortRange:
        """`"30000-30100"` (or one port, `"30000"`)."""
        if isinstance(text, PortRange):
            return text
        low, sep, high = str(text).strip().partition("-")
        try:
            lo = int(low)
            hi = int(high) if sep else lo
        except ValueError:
            raise ValueError(f"port range {text!r}: expected LOW-HIGH, e.g. 30000-30100") from None
        return cls(lo, hi)

    def __iter__(self):
        return iter(range(self.low, self.high + 1))

    def __len__(self) -> int:
        return self.high - self.low + 1

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def bind(host: str = "127.0.0.1", port: int = 0, port_range: PortRange | None = None):
    """A TCP socket bound to `host` and listening: on `port` if given (non-zero), else on the
    first free port of `port_range`, else on a port the kernel picks. Listening at once holds the
    port against every other binder, also ones that set SO_REUSEADDR (set here too, so a
    restarted server can take its old port while connections of the dead one sit in TIME_WAIT).
    Raises OSError for a taken `port`, NoFreePort when the whole range is taken."""
    if port:
        return _bind_one(host, port)
    if port_range is None:
        return _bind_one(host, 0)
    for candidate in port_range:
        try:
            return _bind_one(host, candidate)
        except OSError:
            continue
    raise NoFreePort(f"no free port in {port_range} on {host}: all {len(port_range)} are in use")


def _bind_one(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose protocol says
    # TCP; with 0, Nagle meets the client's delayed ACK and every small reply waits ≈45 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1", port_range: PortRange | None = None) -> int:
    """A port that was free a moment ago, for a program that binds it itself (it may be taken in
    between: prefer a server that reports its own port)."""
    with bind(host, 0, port_range) as sock:
        return sock.getsockname()[1]


def write_port_file(path: str | Path, port: int) -> None:
    """`port` into `path`, atomically: a reader never sees a partial number."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def read_port_file(path: str | Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def add_port_arguments(ap: argparse.ArgumentParser, default_port: int) -> None:
    """`--host`, `--port`, `--port-range`, `--port-file` for a server's command line."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port to bind (0: any free one; default {default_port}, or the first free port "
        "of --port-range when that is given)",
    )
    ap.add_argument(
        "--port-range",
        type=PortRange.parse,
        default=None,
        metavar="LOW-HIGH",
        help="bind the first free port in this range, e.g. 30000-30100",
    )
    ap.add_argument("--port-file", default=None, help="write the bound port to this file")
    ap.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
        "MILES_API_KEY environment variable, which is better: a command line shows in ps); "
        "needed for any --host other than loopback",
    )
    ap.set_defaults(_default_port=default_port)


def bind_from_args(args: argparse.Namespace, what: str) -> socket.socket:
    """Binds as the parsed arguments say and writes the port file (`--port-file`), or exits
    non-zero naming the address and the reason; `announce` says "listening" once the server
    has passed its start-up checks. Resolves the server's key into
    `args.api_key` (`--api-key`, else MILES_API_KEY; processes/auth.py) and refuses, before binding,
    an address other than loopback without one."""
    from miles_core.processes.auth import API_KEY_ENV, is_loopback, resolve_key

    args.api_key = resolve_key(getattr(args, "api_key", None))
    if not args.api_key and not is_loopback(args.host):
        sys.exit(
            f"{what}: refusing to serve on {args.host} without an API key: anyone who can reach "
            f"it could drive it. Set {API_KEY_ENV} (or --api-key) so every route but /health "
            "requires 'Authorization: Bearer KEY', or bind 127.0.0.1"
        )
    port = args.port
    if port is None:
        port = 0 if args.port_range is not None else args._default_port
    if port and args.port_range is not None and port not in args.port_range:
        sys.exit(f"{what}: --port {port} is outside --port-range {args.port_range}")
    try:
        sock = bind(args.host, port, args.port_range)
    except NoFreePort as e:
        sys.exit(f"{what} failed: {e}")
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        sys.exit(f"{what} on {args.host}:{port} failed: cannot bind: {reason}")
    if args.port_file:
        write_port_file(args.port_file, sock.getsockname()[1])
    return sock


def announce(sock: socket.socket, what: str) -> None:
    """The one line a server prints once it has passed its start-up checks (model loaded,
    family checked) and is about to serve: "<what> listening on HOST:PORT" on stderr."""
    host, port = sock.getsockname()[:2]
    print(f"{what} listening on {host}:{port}", file=sys.stderr, flush=True)
