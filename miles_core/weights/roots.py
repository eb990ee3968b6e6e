"""The places an engine server loads weights from disk (`--weight-roots`): local directories and
fsspec prefixes (`s3://bucket/prefix`, `gs://…`, `http://host:port/prefix`).

`/update_weights_from_disk` names a path; `WeightRoots.confine` answers the path to read or
refuses it before anything is touched:

- no roots configured: every disk load is refused (403);
- a relative path, a `.`/`..` segment, a chained URL (`a::b`), a query or fragment: 400;
- a scheme, host/bucket or prefix that no root covers, and a local path whose real path (symlinks
  followed) lies outside every root: 403, with the same message whether the path exists or not,
  so an answer never says what exists outside the roots.

The runtime starts its engine servers with the disk transport's root (weight_sync.disk_root).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit


def not_found_message(path: str) -> str:
    """The one answer for a path outside the roots and for a missing or unreadable one inside."""
    return f"no safetensors weights at {path!r} under this engine's weight roots"


class WeightPathRefused(ValueError):
    """A disk load names a path the engine does not read; `status` is the HTTP answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class _UrlRoot:
    scheme: str
    netloc: str
    prefix: str  # no trailing slash; "" = the whole bucket / host


def _segments_ok(path: str) -> bool:
    """No `.`/`..` segment, also percent-encoded (a server may decode `%2e%2e` to `..`)."""
    lowered = path.lower()
    if "%2e" in lowered or "%2f" in lowered or "%5c" in lowered:
        return False
    return not any(s in (".", "..") for s in path.split("/"))


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/") or prefix in ("", "/")


class WeightRoots:
    def __init__(self, roots: Iterable[str] = ()):
        self.local: list[str] = []
        self.urls: list[_UrlRoot] = []
        for root in roots:
            root = str(root).strip()
            if not root:
                continue
            if "://" in root:
                if "::" in root:
                    raise ValueError(f"weight root {root!r}: chained fsspec URLs are not roots")
                u = urlsplit(root)
                if not u.scheme or not u.netloc or u.query or u.fragment:
                    raise ValueError(
                        f"weight root {root!r}: give scheme://bucket-or-host/prefix (no query)"
                    )
                if not _segments_ok(u.path):
                    raise ValueError(f"weight root {root!r}: no '.' or '..' segments")
                if u.scheme == "file":
                    self.local.append(os.path.realpath(u.path or "/"))
                else:
                    self.urls.append(_UrlRoot(u.scheme, u.netloc, u.path.rstrip("/")))
            else:
                if not os.path.isabs(root):
                    raise ValueError(f"weight root {root!r} must be an absolute path")
                self.local.append(os.path.realpath(root))

    def __bool__(self) -> bool:
        return bool(self.local or self.urls)

    def describe(self) -> list[str]:
        return self.local + [f"{r.scheme}://{r.netloc}{r.prefix}" for r in self.urls]

    def confine(self, path: str) -> str:
        """The path to read (a local real path, or the URL as given), or WeightPathRefused."""
        if not self:
            raise WeightPathRefused(
                403,
                "this engine loads no weights from disk: it was started without --weight-roots",
            )
        outside = WeightPathRefused(403, not_found_message(path))
        if "\x00" in path or "::" in path:
            raise WeightPathRefused(400, f"model_path {path!r} is not a plain path or URL")
        if "://" in path:
            u = urlsplit(path)
            if u.scheme == "file" and not (u.netloc or u.query or u.fragment):
                return self._confine_local(u.path, path, outside)
            if u.query or u.fragment or not u.scheme or not u.netloc:
                raise WeightPathRefused(
                    400, f"model_path {path!r}: give scheme://bucket-or-host/path (no query)"
                )
            if not _segments_ok(u.path):
                raise WeightPathRefused(400, f"model_path {path!r} has '.' or '..' segments")
            for r in self.urls:
                if (r.scheme, r.netloc) == (u.scheme, u.netloc) and _within(u.path, r.prefix):
                    return path
            raise outside
        return self._confine_local(path, path, outside)

    def _confine_local(self, local: str, given: str, outside: WeightPathRefused) -> str:
        if not os.path.isabs(local):
            raise WeightPathRefused(
                400, f"model_path {given!r} is relative: give an absolute path under a weight root"
            )
        if not _segments_ok(local):
            raise WeightPathRefused(400, f"model_path {given!r} has '.' or '..' segments")
        real = os.path.realpath(local)
        if not self.contains_local(real):
            raise outside
        return real

    def contains_local(self, real: str) -> bool:
        """Whether a real (resolved) local path lies inside a local root."""
        return any(os.path.commonpath([real, root]) == root for root in self.local)
