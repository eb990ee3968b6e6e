"""Processes by PID, through psutil: whether a PID is still *our* process, its descendants, its
process group, and stopping a process's descendants.

A PID alone does not name a process: once it exits, the kernel may hand the number to another
program. `ProcessIdentity` pairs the PID with the process's start time (`create_time()`), so a
recorded identity whose PID now belongs to someone else reads as gone, never as ours. Zombies
(exited, not yet reaped) count as gone everywhere here.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass

import psutil

GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
# create_time() is boot time + start ticks / CLK_TCK: the same process always reads the same value;
# the tolerance only absorbs float formatting in records written to disk
_SAME_START_S = 1e-3


def _live(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() not in GONE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (whoever it belongs to now)."""
    try:
        return _live(psutil.Process(pid))
    except (psutil.NoSuchProcess, ValueError):
        return False


def start_time(pid: int) -> float | None:
    """The start time (`psutil.Process.create_time()`, seconds since the epoch) of `pid`, or None
    when there is no such live process."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() if _live(proc) else None
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, not just a PID: a reused PID does not match."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of the live process `pid` now, or None when there is none."""
        started = start_time(pid)
        return None if started is None else cls(pid, started)

    def alive(self) -> bool:
        """The same process (PID and start time) still runs and is not a zombie."""
        started = start_time(self.pid)
        return started is not None and math.isclose(
            started, self.create_time, rel_tol=0, abs_tol=_SAME_START_S
        )


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (children, grandchildren, ...); [] when `pid` is gone."""
    return [c.pid for c in children(pid)]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and _live(proc):
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return members


def kill_pids(pids: list[int] | set[int], sig: int = signal.SIGKILL) -> list[int]:
    """Sends `sig` to each PID still alive; returns those it reached."""
    reached = []
    for pid in pids:
        if not pid_alive(pid):
            continue
        try:
            os.kill(pid, sig)
            reached.append(pid)
        except ProcessLookupError:
            pass
    return reached


def children(pid: int) -> list[psutil.Process]:
    """The live descendants of `pid` as psutil handles: signalling one later goes nowhere if its
    PID was reused meanwhile (psutil checks the start time)."""
    try:
        found = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, ValueError):
        return []
    return [c for c in found if _live(c)]


def terminate(procs: list[psutil.Process], timeout: float = 10.0) -> list[int]:
    """SIGTERM to each, SIGKILL to those still running `timeout` s later; returns the PIDs that
    had to be killed. For processes this one did not start with `subprocess` (a `Popen` is
    stopped through its own handle, which keeps its exit code)."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [p.pid for p in alive]
