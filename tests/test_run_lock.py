"""A run claims its name (one lock file at the checkpoint root, atomic create), so a second run of
the same name is refused while the first lives; a dead owner's lock is taken over on its host
and reported with the command that clears it elsewhere; local disks and S3 (a real moto server).
And what a run leaves behind: a Prefect API server it watches stops with it, also after kill -9.
Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from miles_core.checkpoint.run_lock import (
    LockOwner,
    RunClaim,
    RunLocked,
    _Store,
    check_unclaimed,
    claim,
    held_here,
    release,
)
from miles_core.processes.identity import ProcessIdentity

SCRIPTS = Path(__file__).parent / "scripts"
BUCKET = "miles-locks"


def _holders(root: str, name: str, n: int, options: dict | None = None) -> list[subprocess.Popen]:
    """`n` processes that claim `name` at the same moment (each waits for a line on stdin)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "hold_run_lock.py"), root, name]
            + ([json.dumps(options)] if options else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:  # the start signal, to all at once
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def _results(procs: list[subprocess.Popen]) -> list[dict]:
    return [json.loads(p.stdout.readline()) for p in procs]


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.close()
    for p in procs:
        assert p.wait(30) == 0


@contextlib.contextmanager
def _live_process():
    """A live process of this host (`sleep`, started and stopped here), as a lock owner."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        ident = ProcessIdentity.of(proc.pid)
        assert ident is not None
        yield ident
    finally:
        proc.kill()
        proc.wait(30)


def _dead_identity() -> ProcessIdentity:
    """The identity of a process that ran on this host and is gone (killed and reaped), as a run
    killed with SIGKILL leaves it."""
    with _live_process() as ident:
        pass
    assert not ident.alive()
    return ident


def _write_owner(
    store: _Store, name: str, ident: ProcessIdentity, host: str | None = None
) -> LockOwner:
    """A lock of run `name` owned by `ident` (what another run's claim wrote)."""
    owner = LockOwner(
        run=name,
        host=host or socket.gethostname(),
        pid=ident.pid,
        create_time=ident.create_time,
        run_id="0" * 32,
        started="earlier",
    )
    if store.local:
        os.makedirs(store.dir, exist_ok=True)
    store.replace(store.path(name), owner.encode())
    return owner


def test_runs_of_one_name_started_together_only_one_claims_it(tmp_path):
    """Issue 14 reproduction: two `miles train` of one name started together both passed
    preflight and the second overwrote the first's checkpoints. Two processes claim at once:
    one holds the name, the other is refused naming it; once it releases, the name is free."""
    root = str(tmp_path / "ckpt")
    procs = _holders(root, "twin", 2)
    try:
        results = _results(procs)
        winners = [r for r in results if r["claimed"]]
        assert len(winners) == 1, results
        for r in results:
            if not r["claimed"]:
                assert f"run 'twin' is already running (pid {winners[0]['pid']} on" in r["error"]
        lock = json.loads((tmp_path / "ckpt" / ".locks" / "twin.lock").read_text())
        assert lock["pid"] == winners[0]["pid"] and lock["host"] == socket.gethostname()
        assert lock["create_time"] == psutil.Process(lock["pid"]).create_time()
        assert len(lock["run_id"]) == 32
    finally:
        _finish(procs)
    assert os.listdir(tmp_path / "ckpt" / ".locks") == []  # released at its end, nothing else left
    RunClaim(root, ["twin"]).release()  # free again


def test_the_cli_refuses_a_name_a_live_run_holds_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    """`miles train` of a held name: exit 2 and the owner named, at preflight: no checkpoint
    folder, no MLflow store, no Prefect call (its API points at a closed port)."""
    from flows import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    root = tmp_path / "ckpt"
    with _live_process() as owner:
        _write_owner(_Store(str(root), None), "busy", owner)
        args = ["train", "--set", "name=busy", "--set", f"checkpoint.root={root}"]
        assert cli.main([*args, "--set", "train.num_steps=2"]) == 2
        err = capsys.readouterr().err
        assert f"miles: error: run 'busy' is already running (pid {owner.pid} on" in err
        assert "Traceback" not in err
        assert cli.main([*args, "--resume"]) == 2  # a resume is a run too
        assert "is already running" in capsys.readouterr().err
        assert sorted(p.name for p in root.iterdir()) == [".locks"]
        assert not (tmp_path / "mlflow.db").exists()
        assert cli.main(["run", "unlock", "busy", "--checkpoint-root", str(root)]) == 2
        assert f"run 'busy' is running (pid {owner.pid}" in capsys.readouterr().err


def test_a_dead_owners_lock_is_taken_over_on_its_host_and_cleared_by_command_elsewhere(
    tmp_path, capsys
):
    """A run killed with SIGKILL leaves its lock. On its host the owner is provably dead (its
    PID with its start time no longer runs): the next run (a `--resume`) takes the lock over.
    A lock from another host cannot be checked: refused with the exact command that clears it,
    which works."""
    from flows import cli

    root = str(tmp_path / "ckpt")
    store = _Store(root, None)
    _write_owner(store, "gone", _dead_identity())
    check_unclaimed(root, "gone")  # preflight passes: the claim will take it over
    mine = claim(root, "gone")
    try:
        on_disk = LockOwner.parse(Path(store.path("gone")).read_bytes())
        assert on_disk == mine and mine.pid == os.getpid()
        assert os.listdir(store.dir) == ["gone.lock"]  # no takeover marker left
    finally:
        release(root, "gone")
    assert not Path(store.path("gone")).exists()

    ours = ProcessIdentity.of(os.getpid())
    _write_owner(store, "remote", ours, host="other-host")
    command = f"miles run unlock remote --checkpoint-root {root}"
    for refuse in (lambda: check_unclaimed(root, "remote"), lambda: claim(root, "remote")):
        with pytest.raises(RunLocked, match="cannot be checked from") as e:
            refuse()
        assert f"if that run is no longer running, clear the lock with: {command}" in str(e.value)
    assert cli.main(command.split()[1:]) == 0
    assert "removed the lock of pid" in capsys.readouterr().out
    RunClaim(root, ["remote"]).release()


def test_claims_nest_in_one_process_and_are_released_when_the_run_fails(tmp_path):
    """The CLI claims, then the flow it runs claims again: one lock, removed by the outermost
    release; a run that raises releases too (the flows use `with RunClaim(...)`)."""
    root = str(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / ".locks" / "r.lock"
    with RunClaim(root, ["r", "r-sft"]):
        first = path.read_bytes()
        with pytest.raises(RuntimeError, match="step failed"), RunClaim(root, ["r"]):
            assert path.read_bytes() == first and held_here(root, "r")
            raise RuntimeError("step failed")
        assert path.read_bytes() == first  # the inner release left the outer claim
    assert not path.exists() and not held_here(root, "r")
    assert not (tmp_path / "ckpt" / ".locks" / "r-sft.lock").exists()


@pytest.fixture(scope="module")
def s3(moto_s3):
    """The session's moto server (conftest.py), with this module's bucket."""
    import fsspec

    fsspec.filesystem("s3", **moto_s3).mkdir(BUCKET)
    return moto_s3


def test_on_s3_the_claim_is_a_conditional_write(s3):
    """On an object store the create is `PutObject` with `If-None-Match: *` (a plain put would
    overwrite): a second create of the same key fails; a live owner's lock refuses a claim, a
    dead owner's is taken over, and the release deletes it."""
    root = f"s3://{BUCKET}/ckpt"
    store = _Store(root, s3)
    key = store.path("probe")
    assert store.create(key, b"first") and not store.create(key, b"second")
    assert store.fs.cat_file(key) == b"first"

    with RunClaim(root, ["mine"], s3) as held:
        assert LockOwner.parse(store.fs.cat_file(store.path("mine"))).pid == os.getpid()
        assert held.names == ["mine"]
    assert not store.fs.exists(store.path("mine"))

    with _live_process() as owner:
        _write_owner(store, "shared", owner)
        with pytest.raises(RunLocked, match=f"run 'shared' is already running \\(pid {owner.pid}"):
            RunClaim(root, ["shared"], s3)

    _write_owner(store, "crashed", _dead_identity())
    with RunClaim(root, ["crashed"], s3):
        assert LockOwner.parse(store.fs.cat_file(store.path("crashed"))).pid == os.getpid()
    assert not store.fs.exists(store.path("crashed"))


# ---------------------------------------------------------------- what a run leaves behind


def _wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def _kill_run_and_expect_gone(run: subprocess.Popen, server: int, timeout: float) -> None:
    """SIGKILL of the run (no cleanup of its own runs); its server must exit by itself."""
    run.send_signal(signal.SIGKILL)
    run.wait(10)
    assert _wait_gone(server, timeout), "the server outlived its run"


def _stop(run: subprocess.Popen, server: int) -> None:
    if psutil.pid_exists(server):
        os.kill(server, signal.SIGKILL)
    run.kill()


def test_the_watched_server_wrapper_exits_when_its_owner_is_killed(tmp_path):
    """`python -m flows.prefect_server` with `MILES_PARENT_PID` (how the tests' shared Prefect
    API starts) serves what uvicorn serves, and exits once the process that started it is
    killed with SIGKILL (issue 14: a Prefect server stayed, re-parented to PID 1)."""
    from miles_core.processes.ports import free_port

    port = free_port()
    parent_code = (
        "import os, subprocess, sys\n"
        "env = {**os.environ, 'MILES_PARENT_PID': str(os.getpid())}\n"
        "child = subprocess.Popen([sys.executable, '-m', 'flows.prefect_server', '--factory',"
        f" 'tiny_asgi:create', '--app-dir', {str(SCRIPTS)!r}, '--port', '{port}',"
        " '--log-level', 'error'], env=env)\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    server = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while True:  # until it serves
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/", timeout=2).text == "ok"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and psutil.pid_exists(server)
                time.sleep(0.1)
        _kill_run_and_expect_gone(parent, server, 20)
    finally:
        _stop(parent, server)
