"""A sandbox per episode: bubblewrap (Debian's `bubblewrap`) around every command, with

- its own workspace, the only writable place, seen as /workspace;
- a read-only view of the system (/usr, /etc and the merged-/usr symlinks), nothing else of the
  host: no /root, /home, /work, host /tmp; a private /tmp and /proc;
- no network, no IPC, its own PID namespace (all of it dies with the command);
- rlimits on CPU time, address space, file size and open files (set by util-linux `prlimit`,
  which execs bwrap: no `preexec_fn` in this threaded process), and a wall-clock limit enforced
  from outside; a 64 MiB private /tmp. As root, every sandbox runs as its own unprivileged uid
  with a process limit, so fork bombs in one episode cannot starve another (not as another user:
  then the PID namespace and the wall clock bound them). The uid is dropped by util-linux
  `setpriv` in the exec chain, not by `Popen(user=…)`: a Popen that changes credentials cannot
  use vfork and copies the whole (trainer-sized) process holding the GIL, ≈68 ms a command at
  1.6 GB against ≈2 ms, during which every episode's event loop waits;
- a disk quota on the whole workspace (`disk_mb`): its usage is measured while a command runs
  (every `QUOTA_POLL_S`) and after; a command that fills it past the quota is killed
  ("disk quota") and what it wrote past the quota is truncated away (`Workspace.trim`), so the
  workspace never holds more than the quota after a command;
- every process reaped here: the chain starts with util-linux `unshare --pid --fork`, whose
  child is the init of a PID namespace around bwrap. The outer bwrap exits without waiting for
  the init of its own namespace; without the outer namespace that init would be left a zombie
  for the host's PID 1 to reap (in a container whose PID 1 does not reap, they pile up).

The host side of the workspace (`path`, `read`, `write`, `kind`) never follows a symbolic link
(`workspace.py`).

Whatever a command does, `run` returns a `RunResult` (exit code, the first `output_kb` of its
output, what killed it); it never raises for the command's behaviour.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from miles_core.envs.workspace import Workspace

_UIDS = itertools.count()
TMP_BYTES = 64 << 20  # the sandbox's private /tmp
_UID_BASE = 200_000


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 10
    wall_s: float = 20.0
    memory_mb: int = 512
    processes: int = 64
    file_mb: int = 16
    output_kb: int = 16
    open_files: int = 256
    disk_mb: int = 64  # the whole workspace


@dataclass
class RunResult:
    exit_code: int | None
    output: str
    truncated: bool
    killed_by: str | None  # "wall time", "cpu time", "file size", or a signal name
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None


_SIGNALS = {signal.SIGXCPU: "cpu time", signal.SIGXFSZ: "file size", signal.SIGKILL: "SIGKILL"}
QUOTA_POLL_S = 0.05


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` (make does this)"
        )
    return path


def prlimit_path() -> str:
    return _util_linux("prlimit")


def _util_linux(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailable(f"{name} is not installed: `apt-get install util-linux`")
    return path


class Sandbox:
    def __init__(self, limits: SandboxLimits | None = None, parent: str | Path | None = None):
        self.limits = limits or SandboxLimits()
        self.bwrap = bwrap_path()
        self.prlimit = prlimit_path()
        self.unshare = _util_linux("unshare")
        self.setpriv = _util_linux("setpriv") if os.geteuid() == 0 else None
        self.root = Path(tempfile.mkdtemp(prefix="miles-sandbox-", dir=parent)).resolve()
        self.root.chmod(0o711)  # the sandbox uid may pass through to its workspace, not list
        blocked = [d for d in self.root.parents if not d.stat().st_mode & stat.S_IXOTH]
        if os.geteuid() == 0 and blocked:
            shutil.rmtree(self.root, ignore_errors=True)
            raise SandboxUnavailable(
                f"{blocked[0]} is not passable by the sandbox's own uid (needs o+x); "
                "put sandboxes elsewhere (default: the system temp dir)"
            )
        self.workspace = self.root / "workspace"
        self.workspace.mkdir()
        self.uid = _UID_BASE + (os.getpid() % 1000) * 1000 + next(_UIDS) % 1000
        if os.geteuid() == 0:
            os.chown(self.workspace, self.uid, self.uid)
        self.files = Workspace(self.workspace, self.uid if os.geteuid() == 0 else None)
        self.commands = 0

    # ------------------------------------------------------------------ host side
    def path(self, relative: str) -> Path:
        """The host path of `relative` in the workspace, checked lexically (no `..`, not
        absolute); for reading and writing use `read` / `write`, which follow no link."""
        return self.workspace.joinpath(*self.files.parts(relative))

    def kind(self, relative: str) -> str:
        """What is at `relative`: file, directory, link, missing or other (`Workspace.kind`)."""
        return self.files.kind(relative)

    def write(self, relative: str, text: str) -> None:
        self.files.write(relative, text)

    def read(self, relative: str, limit: int = 1 << 20) -> str | None:
        """The file's text; None if there is no file; `WorkspaceLink` (a ValueError) for a
        symbolic link."""
        return self.files.read(relative, limit)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ commands
    def _argv(self, command: str) -> list[str]:
        argv = [
            *self._prlimit(),
            *self._reaper(),
            *self._identity(),
            self.bwrap,
            "--ro-bind",
            "/usr",
            "/usr",
            "--ro-bind",
            "/etc",
            "/etc",
        ]
        for name in ("bin", "sbin", "lib", "lib64", "lib32"):
            target = Path("/") / name
            if target.is_symlink():
                argv += ["--symlink", os.readlink(target), f"/{name}"]
            elif target.is_dir():
                argv += ["--ro-bind", str(target), f"/{name}"]
        argv += [
            "--bind", str(self.workspace), "/workspace",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp",  # tmpfs pages escape RLIMIT_AS
            "--dev", "/dev",
            "--proc", "/proc",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--chdir", "/workspace",
            "--setenv", "HOME", "/workspace",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            # no .pyc: an edit within the same second and size would run stale bytecode
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "/bin/sh", "-c", command,
        ]  # fmt: skip
        return argv

    def _prlimit(self) -> list[str]:
        """rlimits set by util-linux `prlimit`, which then execs bwrap: no `preexec_fn`, which
        is unsafe in a threaded process (agent episodes run sandboxes from many threads)."""
        lim = self.limits
        mb = 1 << 20
        argv = [
            self.prlimit,
            f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",
            f"--as={lim.memory_mb * mb}",
            f"--fsize={lim.file_mb * mb}",
            f"--nofile={lim.open_files}",
            "--core=0",
        ]
        if os.geteuid() == 0:  # the child runs as the sandbox's own uid: the process limit holds
            argv.append(f"--nproc={lim.processes}")
        return [*argv, "--"]

    def _reaper(self) -> list[str]:
        """`unshare --pid --fork`: its child, the rest of the chain, is the init of a PID
        namespace of its own; every process below it, bwrap's own init included, is reaped
        there when it exits, and `unshare` waits for it. Not root: in a user namespace of
        ours (which bwrap then nests in)."""
        user = [] if os.geteuid() == 0 else ["--user", "--map-current-user"]
        return [self.unshare, *user, "--pid", "--fork", "--kill-child", "--"]

    def _identity(self) -> list[str]:
        """As root: `setpriv` drops the chain to the sandbox's own uid and gid, no other
        groups, before bwrap runs (capabilities go with the uid)."""
        if self.setpriv is None:
            return []
        u = self.uid
        return [self.setpriv, f"--reuid={u}", f"--regid={u}", "--clear-groups", "--"]

    def run(self, command: str) -> RunResult:
        """Runs `command` with /bin/sh in the sandbox; never raises for what the command does."""
        self.commands += 1
        out_path = self.root / f"out-{self.commands}.txt"
        quota = self.limits.disk_mb << 20
        started, since = time.monotonic(), time.time()
        deadline = started + self.limits.wall_s
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(  # noqa: S603
                self._argv(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            killed_by, poll_s = None, QUOTA_POLL_S
            while True:
                left = deadline - time.monotonic()
                try:
                    code = proc.wait(timeout=max(0.0, min(poll_s, left)))
                    break
                except subprocess.TimeoutExpired:
                    measured = time.monotonic()
                    if measured >= deadline:
                        killed_by = "wall time"
                    elif self.files.usage() > quota:
                        killed_by = "disk quota"
                    else:  # a large workspace is measured less often: at most 10% of a core
                        poll_s = max(QUOTA_POLL_S, 10 * (time.monotonic() - measured))
                        continue
                    _kill_chain(proc)
                    code = None
                    break
        if code is not None and code < 0:
            killed_by, code = _SIGNALS.get(-code, signal.Signals(-code).name), None
        elif code is not None and code > 128 and (code - 128) in _SIGNALS:
            killed_by, code = _SIGNALS[code - 128], None  # bwrap reports a child's signal
        if self.files.trim(quota, since):  # what it wrote past the quota after the last poll
            killed_by, code = killed_by or "disk quota", None
        size = out_path.stat().st_size
        keep = self.limits.output_kb * 1024
        with open(out_path, "rb") as f:
            text = f.read(keep).decode(errors="replace")
        out_path.unlink()
        return RunResult(code, text, size > keep, killed_by, time.monotonic() - started)


def _kill_chain(proc: subprocess.Popen) -> None:
    """Kills the sandbox's namespace init (bwrap's own, which takes every process of the
    sandbox with it) and waits for the chain to exit: the outer bwrap reaps it and exits, then
    `unshare` reaps that. Killing `unshare` itself would leave its child to the host's PID 1;
    killing its child would make it re-raise SIGKILL, which it cannot, and say so on stderr."""
    below = _children(proc.pid)
    targets = [g for c in below for g in _children(c)] or below  # not forked yet: its child
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # no /proc children list here: the whole group then
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
