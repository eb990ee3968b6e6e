"""Weight buckets in shared memory: the trainer writes a bucket's tensors into one file under
/dev/shm and sends only its description; an engine process on the same host maps the file (the
mapping is cached) and loads the tensors.

Zero-copy (`adopt`): the engine's parameters become views of the shared files instead of copies,
so a push costs one memcpy (the trainer's write). Files come in two sets (parity 0/1) and pushes
alternate between them: the trainer only ever writes the set the engines are not serving from.
The parity flips only after every engine took the push; after a failed push the transport stops
adopting (engines copy), because some engine may still be reading either set.

A description is the JSON string that travels in SGLang's `serialized_named_tensors` field with
`load_format: "shared_memory"`: {"path", "nbytes", "adopt", "tensors": [{"name", "dtype",
"shape", "offset"}]}.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_core.weights.source import WIRE_DTYPES

ALIGN = 64
PREFIX = "miles-weights-"  # every bucket file's name starts so; an engine maps no other file
_DTYPES = WIRE_DTYPES


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


class ShmBucketWriter:
    """Owns the bucket files of one transport; `write` fills slot i and returns its description."""

    def __init__(self, prefix: str | None = None):
        self.prefix = PREFIX + (prefix or f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._files: dict[int, tuple[Path, torch.Tensor]] = {}
        self._paths: list[Path] = []
        # the files are removed by `close`, or when the writer is collected / the process exits
        self._finalizer = weakref.finalize(self, _unlink, self._paths)

    def write(
        self,
        slot: int,
        bucket: list[tuple[str, torch.Tensor]],
        parity: int = 0,
        adopt: bool = False,
    ) -> str:
        layout, offset = [], 0
        for name, t in bucket:
            layout.append(
                {
                    "name": name,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": offset,
                }
            )
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        key = 2 * slot + parity
        buf = self._buffer(key, offset)
        for (_, t), spec in zip(bucket, layout, strict=True):
            nbytes = t.numel() * t.element_size()
            dst = buf[spec["offset"] : spec["offset"] + nbytes].view(t.dtype)
            dst.copy_(t.detach().reshape(-1))
        path = self._files[key][0]
        return json.dumps({"path": str(path), "nbytes": offset, "adopt": adopt, "tensors": layout})

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        held = self._files.get(slot)
        if held is not None and held[1].numel() >= nbytes:
            return held[1]
        path = shm_dir() / f"{self.prefix}-{slot}"
        size = max(nbytes, ALIGN)
        # this user's only (engines map no other owner's file), never through a planted link
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._files[slot] = (path, buf)
        self._paths.append(path)
        return buf

    def close(self) -> None:
        self._files.clear()
        self._finalizer()


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@dataclass
class SharedBucket:
    tensors: list[tuple[str, torch.Tensor]]  # views into the shared file
    adopt: bool  # the engine may keep the views as its parameters


_MAPPED: dict[tuple[str, int, int], torch.Tensor] = {}  # (path, inode, size) → mapping


def _map(path: str, size: int, fd: int) -> torch.Tensor:
    """The shared mapping of an opened bucket file (cached while the file is the same)."""
    key = (path, os.fstat(fd).st_ino, size)
    buf = _MAPPED.get(key)
    if buf is None:
        for old in [k for k in _MAPPED if k[0] == path]:
            del _MAPPED[old]  # the writer replaced the file: drop the stale mapping
        # mapped through the descriptor that was checked, not the name (which could be
        # swapped for a link between the check and the mapping)
        target = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path
        buf = _MAPPED[key] = torch.from_file(target, shared=True, size=size, dtype=torch.uint8)
    return buf


def unlink_mapped() -> list[str]:
    """Removes every bucket file this process mapped; an engine server calls it when the
    trainer that wrote them died without its own cleanup (SIGKILL). Only a file that is still
    the one mapped (same inode, a regular bucket file of this user in the shm directory) is
    removed; anything else now at that name is left alone. Returns the paths removed."""
    removed = []
    for path, inode in sorted({(k[0], k[1]) for k in _MAPPED}):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_ino == inode and _is_bucket_file(path) and st.st_uid == os.getuid():
            Path(path).unlink(missing_ok=True)
            removed.append(path)
    return removed


def _is_bucket_file(path: str) -> bool:
    """Only files a writer of this module made: a request names the bucket, never an arbitrary
    file (the engine maps it shared, may adopt it as its weights, and unlinks it on exit)."""
    p = Path(path)
    if not p.is_absolute() or p.is_symlink() or not p.is_file() or not p.name.startswith(PREFIX):
        return False
    return p.resolve().parent == shm_dir().resolve()


def _open_bucket(path: str) -> int:
    """A descriptor of the bucket file: a regular file (no link, FIFO or device), owned by
    this process's user, in the shm directory, named as a writer names it; else ValueError."""
    refused = ValueError(
        f"shared-memory bucket {path!r} is not a {PREFIX}* file of this user in {shm_dir()}"
    )
    if not isinstance(path, str) or not _is_bucket_file(path):
        raise refused
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise refused from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise refused
    return fd


def read_bucket(description: str, max_bytes: int | None = None) -> SharedBucket:
    """Maps a described bucket: views into the shared file (copy them unless `adopt`).
    `max_bytes`: the largest bucket (and file) this engine maps (a server: its model's size)."""
    try:
        spec = json.loads(description)
        path, nbytes, tensors = spec["path"], int(spec["nbytes"]), list(spec["tensors"])
        adopt = bool(spec.get("adopt", False))
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise ValueError(f"malformed shared-memory bucket description: {e!r}") from e
    if nbytes < 0 or (max_bytes is not None and nbytes > max_bytes):
        raise ValueError(f"shared-memory bucket of {nbytes} bytes: more than this model holds")
    layout = [_tensor_spec(t, nbytes) for t in tensors]
    fd = _open_bucket(path)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory bucket {path!r} is smaller than described")
        if max_bytes is not None and size > max_bytes + ALIGN:
            raise ValueError(f"shared-memory bucket {path!r} is larger than this model holds")
        buf = _map(path, size, fd)
    finally:
        os.close(fd)
    out = [
        (name, buf[start : start + count * dtype.itemsize].view(dtype).view(shape))
        for name, dtype, shape, start, count in layout
    ]
    return SharedBucket(out, adopt)


def _tensor_spec(t, nbytes: int) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, offset, elements) of one described tensor, inside the bucket."""
    try:
        name, dtype = str(t["name"]), _DTYPES.get(t["dtype"])
        shape = [int(d) for d in t["shape"]]
        start = int(t["offset"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"malformed shared-memory tensor description: {e!r}") from e
    if dtype is None:
        raise ValueError(f"unsupported dtype {t['dtype']!r} for {name}")
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in the shape {shape} of {name}")
    count = 1
    for d in shape:
        count *= d
    if start < 0 or start + count * dtype.itemsize > nbytes:
        raise ValueError(f"tensor {name} lies outside its bucket")
    return name, dtype, shape, start, count
