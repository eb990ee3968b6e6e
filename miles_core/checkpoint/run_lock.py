"""A run claims its name: one lock file per run name at the checkpoint root, so a second run of
the same name is refused while the first lives (it would overwrite the first's checkpoints, and
the first's registered versions would then name files whose sha256 differs from their tags).

    <checkpoint root>/.locks/<run name>.lock      JSON: run, host, pid, create_time, run_id, started

- **Claim** is one atomic create. On a local disk the content is written under a name of its
  own (`O_CREAT | O_EXCL`) and published with `link()`, which fails if the lock exists (as
  atomic as `O_EXCL` on the lock itself, and no reader sees it empty; `O_EXCL` on the lock where
  a file system has no hard links). On an object store it is a conditional write (`PutObject`
  with `If-None-Match: *`, s3fs `pipe_file(mode="create")`). Of two runs started together
  exactly one creates the file; the other is refused.
- **Owner**: host name, PID and the process's start time (`ProcessIdentity`: a reused PID is not
  taken for the owner), and a `run_id` (a fresh id per claim, which the release and a takeover
  compare, so nobody removes a lock that is not the one they read).
- **Stale** (the owner is dead): on the owner's own host the death is provable (the recorded PID
  no longer runs with the recorded start time), and the next run of that name, `--resume`
  included, takes the lock over (logged). The takeover is itself one atomic create of a marker
  named after the stale claim (`<lock>.takeover-<run_id>`), so of two runs taking over the same
  stale lock one does, and the lock is then replaced. On another host the owner's liveness
  cannot be checked: the run is refused with the command that clears the lock,
  `miles run unlock NAME --checkpoint-root ROOT`.
- **Release** when the run ends, also when it fails (the CLI and the flows release in
  `finally`); a process killed with SIGKILL leaves a stale lock, taken over as above.
- Claims are re-entrant within one process: the CLI claims before Prefect starts, and the flow
  it then runs claims the same names again (a no-op); the outermost claim releases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from miles_core.processes.identity import ProcessIdentity

log = logging.getLogger(__name__)

LOCK_DIR = ".locks"


class RunLocked(ValueError):
    """The run name is claimed by another run (alive, or not provably dead)."""


@dataclass(frozen=True)
class LockOwner:
    run: str
    host: str
    pid: int
    create_time: float
    run_id: str
    started: str

    @classmethod
    def me(cls, run: str) -> LockOwner:
        ident = ProcessIdentity.of(os.getpid())
        assert ident is not None  # this process is alive
        return cls(
            run=run,
            host=socket.gethostname(),
            pid=ident.pid,
            create_time=ident.create_time,
            run_id=uuid.uuid4().hex,
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )

    @classmethod
    def parse(cls, data: bytes) -> LockOwner | None:
        """The owner a lock file names; None for a file that is not one (no claim leaves a torn
        file: a put is whole, a local lock is published complete by link())."""
        try:
            raw = json.loads(data)
            return cls(
                run=str(raw["run"]),
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                create_time=float(raw["create_time"]),
                run_id=str(raw["run_id"]),
                started=str(raw.get("started", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    def alive(self) -> bool | None:
        """True / False on the owner's own host; None elsewhere (it cannot be checked)."""
        if self.host != socket.gethostname():
            return None
        return ProcessIdentity(self.pid, self.create_time).alive()

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}, run id {self.run_id}"


def unlock_command(root: str, name: str, storage_options: dict | None = None) -> str:
    """The exact command that clears the lock of run `name` under `root`."""
    extra = (
        " --storage-options JSON (the run's checkpoint.storage_options)" if storage_options else ""
    )
    return f"miles run unlock {name} --checkpoint-root {root}{extra}"


class _Store:
    """The lock directory: atomic create, read, replace and delete of small files, on a local
    disk (os calls) or any fsspec object store (conditional writes)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None):
        self.root = root.rstrip("/")
        self.fs, base = url_to_fs(self.root, **(storage_options or {}))
        self.local = isinstance(self.fs, LocalFileSystem)
        self.dir = f"{base}/{LOCK_DIR}"

    def path(self, name: str) -> str:
        return f"{self.dir}/{name}.lock"

    def create(self, path: str, data: bytes) -> bool:
        """Creates `path` holding `data` unless it exists (then False); atomic."""
        if self.local:
            os.makedirs(self.dir, exist_ok=True)
            # the content is written first, under a name of its own (O_CREAT | O_EXCL), then
            # published by link(), which fails if `path` exists: as atomic as O_EXCL on `path`,
            # and no reader ever sees the lock empty
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                except OSError:  # a file system without hard links: O_EXCL on the name itself
                    return self._create_excl(path, data)
                return True
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        try:
            self.fs.pipe_file(path, data, mode="create")  # s3: PutObject If-None-Match: *
        except FileExistsError:
            return False
        return True

    @staticmethod
    def _create_excl(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def read(self, path: str) -> bytes | None:
        try:
            if self.local:
                with open(path, "rb") as f:
                    return f.read()
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def replace(self, path: str, data: bytes) -> None:
        if self.local:
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def delete(self, path: str) -> None:
        try:
            if self.local:
                os.unlink(path)
            else:
                self.fs.rm(path)
        except FileNotFoundError:
            pass

    def takeover_markers(self, name: str) -> list[str]:
        prefix = f"{self.path(name)}.takeover-"
        try:
            found = self.fs.ls(self.dir, detail=False)
        except FileNotFoundError:
            return []
        return [str(p) for p in found if str(p).startswith(prefix) and not str(p).endswith(".tmp")]


# (root, name) -> (owner, depth): what this process holds; claims nest
_HELD: dict[tuple[str, str], list[Any]] = {}
_HELD_LOCK = threading.Lock()


def _key(store: _Store, name: str) -> tuple[str, str]:
    return (store.fs.unstrip_protocol(store.dir) if not store.local else store.dir, name)


def held_here(root: str, name: str, storage_options: dict | None = None) -> bool:
    store = _Store(root, storage_options)
    with _HELD_LOCK:
        return _key(store, name) in _HELD


def _refusal(store: _Store, name: str, owner: LockOwner | None, storage_options) -> RunLocked:
    path = store.path(name)
    shown = path if store.local else store.fs.unstrip_protocol(path)
    cmd = unlock_command(store.root, name, storage_options)
    if owner is None:
        return RunLocked(
            f"run {name!r} is locked by {shown}, which names no owner; if no run of that name "
            f"is running, clear it with: {cmd}"
        )
    state = owner.alive()
    if state:
        return RunLocked(
            f"run {name!r} is already running ({owner.describe()}; lock {shown}): wait for it "
            "to finish, stop it, or choose another name"
        )
    return RunLocked(
        f"run {name!r} is locked by {owner.describe()} (lock {shown}), which cannot be checked "
        f"from {socket.gethostname()}; if that run is no longer running, clear the lock with: "
        f"{cmd}"
    )


def check_unclaimed(root: str, name: str, storage_options: dict | None = None) -> None:
    """Preflight: refuses (RunLocked) a name another live run holds, or one whose owner cannot
    be checked from here; a name held by this process or by a provably dead owner passes."""
    store = _Store(root, storage_options)
    with _HELD_LOCK:
        if _key(store, name) in _HELD:
            return
    data = store.read(store.path(name))
    if data is None:
        return
    owner = LockOwner.parse(data)
    if owner is not None and owner.alive() is False:
        return  # stale: the claim takes it over
    raise _refusal(store, name, owner, storage_options)


def _take_over(store: _Store, name: str, stale: LockOwner, mine: LockOwner) -> bool:
    """Replaces the stale lock `stale` with `mine`; False when another run takes it over."""
    path = store.path(name)
    marker = f"{path}.takeover-{stale.run_id}"
    if not store.create(marker, mine.encode()):
        return False
    try:
        now = store.read(path)
        current = LockOwner.parse(now) if now is not None else None
        if current is None or current.run_id != stale.run_id:
            return False  # released or replaced meanwhile
        store.replace(path, mine.encode())
    finally:
        store.delete(marker)
    log.warning(
        "run %r: took over the lock of %s, which is no longer running", name, stale.describe()
    )
    return True


def claim(root: str, name: str, storage_options: dict | None = None) -> LockOwner:
    """Claims run `name` for this process (re-entrant); RunLocked if another run holds it."""
    store = _Store(root, storage_options)
    key = _key(store, name)
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1] += 1
            return _HELD[key][0]
        mine = LockOwner.me(name)
        path = store.path(name)
        for _ in range(3):  # a release or takeover between our read and create: read again
            if store.create(path, mine.encode()):
                break
            data = store.read(path)
            if data is None:
                continue
            owner = LockOwner.parse(data)
            if owner is None or owner.alive() is not False:
                raise _refusal(store, name, owner, storage_options)
            if _take_over(store, name, owner, mine):
                break
        else:
            raise _refusal(store, name, LockOwner.parse(store.read(path) or b""), storage_options)
        _HELD[key] = [mine, 1]
        return mine


def release(root: str, name: str, storage_options: dict | None = None) -> None:
    """Ends this process's claim (the outermost of nested claims removes the lock file, if it
    is still ours)."""
    store = _Store(root, storage_options)
    key = _key(store, name)
    with _HELD_LOCK:
        entry = _HELD.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _HELD[key]
        mine: LockOwner = entry[0]
        path = store.path(name)
        data = store.read(path)
        current = LockOwner.parse(data) if data is not None else None
        if current is not None and current.run_id == mine.run_id:
            store.delete(path)


class RunClaim:
    """Claims of several run names (a run and its SFT warm start), all or none; `release` (or
    leaving the `with` block) ends them."""

    def __init__(self, root: str, names: list[str], storage_options: dict | None = None):
        self.root, self.names, self.storage_options = root, list(names), storage_options
        self._claimed: list[str] = []
        try:
            for name in self.names:
                claim(root, name, storage_options)
                self._claimed.append(name)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        claimed, self._claimed = self._claimed, []
        for name in reversed(claimed):
            try:
                release(self.root, name, self.storage_options)
            except Exception as e:  # noqa: BLE001  (a lock left behind is reported, not fatal)
                log.warning("could not release the lock of run %r: %s", name, e)

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def unlock(root: str, name: str, storage_options: dict | None = None) -> LockOwner | None:
    """`miles run unlock`: removes the lock of run `name` (and takeover markers left by a run
    that died taking it over); refuses one whose owner runs on this host. Returns the owner
    removed (None: there was no lock)."""
    store = _Store(root, storage_options)
    path = store.path(name)
    data = store.read(path)
    owner = LockOwner.parse(data) if data is not None else None
    if owner is not None and owner.alive():
        raise RunLocked(f"run {name!r} is running ({owner.describe()}): stop it instead")
    for marker in store.takeover_markers(name):
        store.delete(marker)
    if data is not None:
        store.delete(path)
    return owner
