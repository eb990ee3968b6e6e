"""The host side of a sandbox's workspace: what a task writes and a checker reads there, never
through a symbolic link, and how much disk the workspace holds.

An episode's commands may leave symbolic links anywhere in the workspace (`ln -s /etc/passwd
answer.txt`, or a link to another file of the workspace that a checker must not mistake for the
answer). Every helper here opens each component of a path beneath the workspace's own directory
descriptor with `O_NOFOLLOW`, so no link is ever followed, whatever an episode does between the
checks: `kind` reports a link as a link, `read` raises `WorkspaceLink` for one, `write` replaces
a link at the path with the file (a link in a parent directory raises). Paths are relative to
the workspace; an absolute path or `..` is refused.

`usage` is the disk the workspace holds (allocated blocks, each file once however many hard
links it has, links not followed): what the sandbox's disk quota (`SandboxLimits.disk_mb`)
counts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WorkspaceLink(ValueError):
    """A path in the workspace is, or goes through, a symbolic link."""


class Workspace:
    def __init__(self, root: Path, owner: int | None = None):
        """`owner`: the uid (and gid) that files and directories written here are given (the
        sandbox's own uid when running as root); None keeps ours."""
        self.root = root
        self.owner = owner

    # ------------------------------------------------------------------ paths
    def parts(self, relative: str) -> list[str]:
        """The components of `relative`; refuses what would leave the workspace."""
        path = PurePosixPath(relative)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError(f"{relative!r} is outside the workspace")
        return [p for p in path.parts if p != "."]

    @contextlib.contextmanager
    def _parent(self, parts: list[str], create: bool = False) -> Iterator[int]:
        """A descriptor of the directory holding the last of `parts`, reached without
        following a link; `create` makes missing directories (owned by `owner`)."""
        fd = os.open(self.root, _DIR)
        try:
            for i, name in enumerate(parts[:-1]):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                        self._own(name, fd)
                try:
                    child = os.open(name, _DIR, dir_fd=fd)
                except OSError as e:
                    self._raise_link(fd, name, parts[: i + 1], e)
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _raise_link(self, dir_fd: int, name: str, parts: list[str], error: OSError) -> None:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            return
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                target = os.readlink(name, dir_fd=dir_fd)
                where = "/".join(parts)
                raise WorkspaceLink(
                    f"{where!r} in the workspace is a symbolic link (to {target!r}); "
                    "links are not followed"
                ) from error

    def _own(self, name: str, dir_fd: int) -> None:
        if self.owner is not None:
            os.chown(name, self.owner, self.owner, dir_fd=dir_fd, follow_symlinks=False)

    # ------------------------------------------------------------------ host-side helpers
    def kind(self, relative: str) -> str:
        """What is at `relative`: "file", "directory", "link" (the path or one of its parent
        directories is a symbolic link), "missing" or "other" (a fifo, a socket, a device)."""
        parts = self.parts(relative)
        if not parts:
            return "directory"
        try:
            with self._parent(parts) as fd:
                mode = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode
        except WorkspaceLink:
            return "link"
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        if stat.S_ISLNK(mode):
            return "link"
        if stat.S_ISREG(mode):
            return "file"
        return "directory" if stat.S_ISDIR(mode) else "other"

    def read(self, relative: str, limit: int = 1 << 20) -> str | None:
        """The first `limit` bytes of the regular file at `relative` (decoded, invalid UTF-8
        replaced); None if nothing or a directory is there; `WorkspaceLink` for a link."""
        parts = self.parts(relative)
        if not parts:
            return None
        try:
            with self._parent(parts) as parent:
                try:
                    # O_NONBLOCK: a fifo left there must not block the reader
                    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                    fd = os.open(parts[-1], flags, dir_fd=parent)
                except OSError as e:
                    self._raise_link(parent, parts[-1], parts, e)
                    raise
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(limit).decode(errors="replace")

    def write(self, relative: str, text: str) -> None:
        """Writes `text` to `relative`, creating its directories; a link at the path is
        replaced by the file, a link on the way raises `WorkspaceLink`."""
        parts = self.parts(relative)
        if not parts:
            raise ValueError("write needs a file name")
        with self._parent(parts, create=True) as parent:
            name = parts[-1]
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, 0o644, dir_fd=parent)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                os.unlink(name, dir_fd=parent)  # the link, not what it points to
                fd = os.open(name, flags | os.O_EXCL, 0o644, dir_fd=parent)
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode())
            self._own(name, parent)

    # ------------------------------------------------------------------ disk
    def usage(self) -> int:
        """Bytes of disk the workspace holds: allocated blocks, each inode once."""
        seen: set[int] = set()
        total = 0
        for entry in self._entries():
            st = entry.stat(follow_symlinks=False)
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
        return total

    def trim(self, to_bytes: int, since: float) -> list[str]:
        """Truncates the files modified at or after `since` (epoch seconds), the largest first,
        until the workspace holds at most `to_bytes`; returns their paths. What a command
        wrote past the quota is discarded, what was there before it is kept."""
        over = self.usage() - to_bytes
        if over <= 0:
            return []
        recent = []
        for entry in self._entries():
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime >= since:
                recent.append((st.st_blocks * 512, st.st_size, entry.path))
        cut = []
        for blocks, size, path in sorted(recent, reverse=True):
            if over <= 0:
                break
            keep = max(0, min(size, blocks - over))
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, keep)
            finally:
                os.close(fd)
            cut.append(os.path.relpath(path, self.root))
            over = self.usage() - to_bytes
        return cut

    def _entries(self) -> Iterator[os.DirEntry]:
        stack = [str(self.root)]
        while stack:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
                with os.scandir(stack.pop()) as it:
                    for entry in it:
                        yield entry
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
