"""Server subprocesses exit when the process that started them dies by SIGKILL (no cleanup ran
there): `miles_core/processes/parent_watch.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.processes import pid_alive as _alive
from miles_core.processes.parent_watch import PARENT_ENV

SCRIPT = Path(__file__).parent / "scripts" / "spawn_servers.py"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_engine_router_and_session_servers_exit_within_seconds_of_a_killed_parent(
    tiny_dir, tmp_path
):
    parent = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tiny_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    pids: dict[str, int] = {}
    try:
        pids = json.loads(parent.stdout.readline())  # type: ignore[union-attr]
        assert all(_alive(p) for p in pids.values())
        parent.kill()  # SIGKILL: the servers' stop() never runs
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and any(_alive(p) for p in pids.values()):
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        assert not [n for n, p in pids.items() if _alive(p)], "a server outlived its parent"
        print(f"servers gone {gone_after:.2f} s after the kill")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids.values():  # only if the test failed: leave nothing running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_server_started_by_hand_is_not_watched(monkeypatch):
    from miles_core.processes.parent_watch import watch_parent

    monkeypatch.delenv(PARENT_ENV, raising=False)
    assert watch_parent() is None
