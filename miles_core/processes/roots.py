"""The roots a server reads from: the local directories and fsspec prefixes it was started with
(an engine's `--weight-roots`, the evaluation service's `--checkpoint-roots`). A URI is served
only when it lies under one of them. The check is on the URI's text (and, for a local path, on
where its symlinks lead) before anything is opened, fetched or listed:

- malformed, `MalformedUri` (400): a relative path, a `.`/`..` segment (also percent-encoded, as
  are `/` and `\\`: a store may decode them), an empty segment of a remote URI, fsspec chaining
  (`::`), a query or fragment (`?`, `#`), a backslash, NUL or another control character, a
  `file://` URL naming a host, a remote URI without a bucket or host;
- outside, `OutsideRoots` (403): another scheme, host, bucket or prefix (prefixes match whole
  segments), a local path whose real path lies outside every local root; and every URI when no
  root is configured. Whether the URI exists plays no part, so the answer never says.

Roots are parsed by the same rules (an absolute local directory, resolved with realpath;
`file:///dir`; `scheme://bucket-or-host/prefix`); a bad one is a ValueError at start-up. Each
server words the 403 its own way (weights/disk.py, eval/service.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL_SCHEMES = ("file", "local")  # fsspec's names for the local file system
_REFUSED_CHARS = "?#\\"  # and every control character (NUL, tab, newline: urlsplit drops some)
_ENCODED = ("%2e", "%2f", "%5c")  # '.', '/', '\' percent-encoded


class RootRefusal(ValueError):
    """A URI a server does not read; `status` is the HTTP answer."""

    status = 400


class MalformedUri(RootRefusal):
    """Not a plain absolute path or `scheme://bucket-or-host/path` (400)."""

    status = 400


class OutsideRoots(RootRefusal):
    """A well-formed URI under none of the roots (403)."""

    status = 403


@dataclass(frozen=True)
class _Prefix:
    scheme: str
    netloc: str
    path: str  # "" (the whole bucket or host) or "/a/b" without a trailing slash

    def covers(self, scheme: str, netloc: str, path: str) -> bool:
        same_store = (scheme, netloc) == (self.scheme, self.netloc)
        return same_store and (path == self.path or path.startswith(self.path + "/"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.path}"


def _split(uri: str, what: str) -> tuple[str | None, str, str]:
    """(scheme, netloc, path) of a URI; scheme None for a local path (a plain one or file://).
    A remote path comes without its trailing slash and with its segments checked."""
    if "::" in uri:
        raise MalformedUri(f"{what} {uri!r}: chained fsspec URLs (::) are not accepted")
    if any(c in _REFUSED_CHARS or ord(c) < 0x20 or c == "\x7f" for c in uri):
        raise MalformedUri(
            f"{what} {uri!r}: '?', '#', backslashes, NUL and control characters are not accepted"
        )
    if any(e in uri.lower() for e in _ENCODED):
        raise MalformedUri(f"{what} {uri!r}: percent-encoded '.', '/', '\\' are not accepted")
    if "://" not in uri:
        return None, "", uri
    try:
        u = urlsplit(uri)
    except ValueError as e:  # e.g. a malformed IPv6 host
        raise MalformedUri(f"{what} {uri!r} is not a URL ({e})") from None
    if not u.scheme or uri[: len(u.scheme)].lower() != u.scheme:
        raise MalformedUri(f"{what} {uri!r}: give an absolute path or scheme://bucket-or-host/path")
    if u.scheme in LOCAL_SCHEMES:
        if u.netloc:
            raise MalformedUri(
                f"{what} {uri!r}: a {u.scheme}:// URL names no host (give {u.scheme}:///dir)"
            )
        return None, "", u.path
    if not u.netloc:
        raise MalformedUri(f"{what} {uri!r} names no bucket or host")
    path = u.path.rstrip("/")
    if any(s in ("", ".", "..") for s in path.split("/")[1:]):
        raise MalformedUri(f"{what} {uri!r}: empty, '.' or '..' path segments are not accepted")
    return u.scheme, u.netloc, path


def _absolute(path: str, uri: str, what: str) -> str:
    if not os.path.isabs(path):
        raise MalformedUri(f"{what} {uri!r} is relative: give an absolute path or a URL")
    return path


@dataclass(frozen=True)
class AllowedRoots:
    local: tuple[str, ...] = ()  # real paths
    remote: tuple[_Prefix, ...] = ()

    @classmethod
    def parse(cls, roots: Iterable[str], what: str = "root") -> AllowedRoots:
        """Roots as given on a command line (blank ones skipped); a ValueError naming the bad
        one otherwise. A local root may be any absolute path: it is resolved with realpath."""
        local: list[str] = []
        remote: list[_Prefix] = []
        for root in roots:
            root = str(root).strip()
            if not root:
                continue
            scheme, netloc, path = _split(root, what)
            if scheme is None:
                local.append(os.path.realpath(_absolute(path, root, what)))
            else:
                remote.append(_Prefix(scheme, netloc, path))
        return cls(tuple(local), tuple(remote))

    def __bool__(self) -> bool:
        return bool(self.local or self.remote)

    def describe(self) -> str:
        names = [*self.local, *map(str, self.remote)]
        return ", ".join(names) if names else "none configured"

    def check(self, uri: str, what: str = "uri") -> str:
        """The URI to read, if it lies under a root: a local one as its real path, a remote one
        as `scheme://netloc/path` (scheme lower-cased, no trailing slash). Else MalformedUri or
        OutsideRoots; `what` names the field in their messages."""
        scheme, netloc, path = _split(uri, what)
        if scheme is None:
            if any(s in (".", "..") for s in _absolute(path, uri, what).split("/")):
                raise MalformedUri(f"{what} {uri!r}: '.' or '..' path segments are not accepted")
            real = os.path.realpath(path)
            if self.contains_local(real):
                return real
        elif any(r.covers(scheme, netloc, path) for r in self.remote):
            return f"{scheme}://{netloc}{path}"
        raise OutsideRoots(f"{what} {uri!r} is not under the roots ({self.describe()})")

    def contains_local(self, real: str) -> bool:
        """Whether a real (resolved) local path lies inside a local root."""
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.local)
