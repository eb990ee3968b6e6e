"""The checkpoint roots an evaluation service reads from (`--checkpoint-roots`): local
directories and fsspec prefixes (`s3://bucket/prefix`). A checkpoint URI is served only when it
lies under one of them; the check is on the URI's text (and, for a local path, on where its
symlinks lead), before anything is opened, so the answer for a path outside the roots is the
same whether it exists or not.

Refused with `ValueError` (400): a relative path, `.`/`..` segments in a remote URI (also
percent-encoded), fsspec URL chaining (`::`), a query or fragment. Refused with `OutsideRoots` (403): every other URI not
under a root (another scheme, bucket or host; a local path that resolves elsewhere)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL_SCHEMES = ("file://", "local://")


class OutsideRoots(PermissionError):
    """A checkpoint URI that is not under any of the service's roots."""


def _split(uri: str) -> tuple[str | None, str]:
    """(scheme, rest) of an fsspec URI; scheme None for a plain local path."""
    for local in LOCAL_SCHEMES:
        if uri.startswith(local):
            return None, uri[len(local) :]
    scheme, sep, rest = uri.partition("://")
    if sep and scheme and scheme.replace("+", "").replace("-", "").isalnum():
        return scheme.lower(), rest
    return None, uri


@dataclass(frozen=True)
class CheckpointRoots:
    local: tuple[str, ...]  # real paths, no trailing separator
    remote: tuple[tuple[str, str], ...]  # (scheme, "bucket/prefix" without a trailing /)

    @classmethod
    def parse(cls, roots: Iterable[str]) -> CheckpointRoots:
        """Roots as given on the command line; raises ValueError for one that cannot be one."""
        local, remote = [], []
        for root in roots:
            root = root.strip()
            if not root:
                continue
            _refuse_tricks(root, "checkpoint root")
            scheme, rest = _split(root)
            if scheme is None:
                if not os.path.isabs(rest):
                    raise ValueError(f"checkpoint root {root!r} must be an absolute path")
                local.append(os.path.realpath(rest))
            else:
                rest = rest.strip("/")
                if not rest:
                    raise ValueError(f"checkpoint root {root!r} names no bucket or host")
                _refuse_dots(rest, root, "checkpoint root")
                remote.append((scheme, rest))
        return cls(tuple(local), tuple(remote))

    def __bool__(self) -> bool:
        return bool(self.local or self.remote)

    def describe(self) -> str:
        names = [*self.local, *(f"{s}://{r}" for s, r in self.remote)]
        return ", ".join(names) if names else "none configured"

    def check(self, uri: str) -> str:
        """The URI to read (a local path resolved through its symlinks), if it lies under a
        root; else raises ValueError (malformed) or OutsideRoots."""
        _refuse_tricks(uri, "checkpoint_uri")
        scheme, rest = _split(uri)
        if scheme is None:
            if not os.path.isabs(rest):
                raise ValueError(f"checkpoint_uri {uri!r} must be an absolute path or a URL")
            real = os.path.realpath(rest)
            for root in self.local:
                if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                    return real
        else:
            _refuse_dots(rest, uri, "checkpoint_uri")
            path = rest.rstrip("/")
            for root_scheme, root in self.remote:
                if scheme == root_scheme and (path == root or path.startswith(root + "/")):
                    return f"{scheme}://{path}"
        raise OutsideRoots(
            f"checkpoint_uri {uri!r} is not under the service's checkpoint roots "
            f"({self.describe()}; start it with --checkpoint-roots to serve others)"
        )


def _refuse_tricks(uri: str, what: str) -> None:
    if "::" in uri:
        raise ValueError(f"{what} {uri!r}: chained fsspec URLs (::) are not accepted")
    if any(c in uri for c in "?#\\\0"):
        raise ValueError(f"{what} {uri!r}: '?', '#', backslashes and NUL are not accepted")


def _refuse_dots(rest: str, uri: str, what: str) -> None:
    lowered = rest.lower()  # percent-encoded dots and slashes too: a store may decode them
    encoded = any(e in lowered for e in ("%2e", "%2f", "%5c"))
    if encoded or any(part in (".", "..") for part in rest.split("/")) or "//" in rest.rstrip("/"):
        raise ValueError(f"{what} {uri!r}: empty, '.' or '..' path segments are not accepted")
