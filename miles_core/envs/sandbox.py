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
  1.6 GB against ≈2 ms, during which every episode's event loop waits. The workspace itself
  has no disk quota beyond the per-file size limit.

Whatever a command does, `run` returns a `RunResult` (exit code, the first `output_kb` of its
output, what killed it); it never raises for the command's behaviour.
"""

from __future__ import annotations

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
        self.commands = 0

    # ------------------------------------------------------------------ host side
    def path(self, relative: str) -> Path:
        """A path inside the workspace (refuses anything that would leave it)."""
        p = (self.workspace / relative).resolve()
        if p != self.workspace and self.workspace not in p.parents:
            raise ValueError(f"{relative!r} is outside the workspace")
        return p

    def write(self, relative: str, text: str) -> None:
        p = self.path(relative)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if os.geteuid() == 0:  # p is inside the (resolved) workspace: the loop stops there
            for q in [p, *p.parents]:
                if q == self.workspace or self.workspace not in q.parents:
                    break
                os.chown(q, self.uid, self.uid)

    def read(self, relative: str, limit: int = 1 << 20) -> str | None:
        p = self.path(relative)
        if not p.is_file():
            return None
        with open(p, "rb") as f:
            return f.read(limit).decode(errors="replace")

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
        t0 = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(  # noqa: S603
                self._argv(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            killed_by = None
            try:
                code = proc.wait(timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code, killed_by = None, "wall time"
        if code is not None and code < 0:
            killed_by = _SIGNALS.get(-code, signal.Signals(-code).name)
            code = None
        elif code is not None and code > 128 and (code - 128) in _SIGNALS:
            killed_by, code = _SIGNALS[code - 128], None  # bwrap reports a child's signal
        size = out_path.stat().st_size
        keep = self.limits.output_kb * 1024
        with open(out_path, "rb") as f:
            text = f.read(keep).decode(errors="replace")
        out_path.unlink()
        return RunResult(code, text, size > keep, killed_by, time.monotonic() - t0)
