"""The Prefect API of a CLI run without `PREFECT_API_URL` (flows/prefect_server.py): one local
server per PREFECT_HOME, started by the first run, reused by the next, stopped once no run has
used it for the idle time (a run killed with SIGKILL no longer counts); a run's log lines, its
last ones included, are in the API when the command returns. Real servers and processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from flows.prefect_server import IDLE_ENV, KEPT_DIR, NAME, stop_local
from infra.processes import ProcessRecord, wait_for

CLIENT = (
    "import sys\n"
    "from flows.prefect_server import use_local_api\n"
    "api = use_local_api()\n"
    "api.wait_ready()\n"
    "from prefect.settings import get_current_settings\n"
    "assert get_current_settings().api.url == api.record.url\n"  # Prefect itself uses it
    "print(api.record.pid, api.started_here, flush=True)\n"
    "sys.stdin.readline()\n"
    "api.release()\n"
)


def _env(home: Path, idle_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | {"PREFECT_HOME": str(home), IDLE_ENV: str(idle_s)}


def _client(env: dict[str, str]) -> tuple[subprocess.Popen, int, bool]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    pid, started = proc.stdout.readline().split()
    return proc, int(pid), started == "True"


@pytest.mark.slow  # a real Prefect server (≈10 s to start) and a 2-step run
def test_runs_share_one_kept_server_which_keeps_their_logs_and_stops_once_idle(tmp_path):
    """A process starts the kept server; `miles train` reuses it and, once the command has
    returned, its flow run is Completed with the step lines and Prefect's last line in its logs;
    a third process reuses it too; the first is killed -9 (its registration is pruned, the
    server stays for the third), the third releases it: the server stops by itself once idle
    and removes its record."""
    home = tmp_path / "prefect"
    env = _env(home, idle_s=2)
    clients = home / KEPT_DIR / "clients"
    first = second = None
    args = [
        "--set", "name=logged", "--set", "model.preset=tiny", "--set", "data.task=say_a",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.n_samples_per_prompt=2",
        "--set", "rollout.max_new_tokens=4", "--set", "train.num_steps=2",
        "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=4",
        "--set", f"checkpoint.root={tmp_path / 'ckpt'}",
        "--set", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]  # fmt: skip
    try:
        first, server, started = _client(env)
        assert started
        record = ProcessRecord.load(home / KEPT_DIR / f"{NAME}.json")
        assert record.pid == server

        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", "train", "--no-progress", *args],
            env=env | {"PREFECT_LOGGING_LEVEL": "INFO"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.splitlines()[-1])["steps"] == 2.0
        assert f"Prefect UI: {record.url.removesuffix('/api')}" in done.stderr  # the same one
        # the UI served there asks this server's API, not port 4200's
        assert (
            httpx.get(record.url.removesuffix("/api") + "/ui-settings").json()["api_url"]
            == record.url
        )
        runs = httpx.post(f"{record.url}/flow_runs/filter", json={}).json()
        assert [r["state_type"] for r in runs] == ["COMPLETED"]
        logs = httpx.post(
            f"{record.url}/logs/filter",
            json={"logs": {"flow_run_id": {"any_": [runs[0]["id"]]}}, "sort": "TIMESTAMP_ASC"},
        ).json()
        messages = [(entry["name"], entry["message"]) for entry in logs]
        assert [m for n, m in messages if n == "miles"][-1].startswith("rl step 2/2 ")
        assert "Finished in state Completed()" in messages[-1][1]

        status = subprocess.run(
            [sys.executable, "-m", "flows.cli", "prefect", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"{record.url.removesuffix('/api')} (pid {server}, 1 runs" in status.stdout

        second, again, started_again = _client(env)
        assert (again, started_again) == (server, False)  # reused, not started twice
        assert {p.name for p in clients.iterdir()} == {str(first.pid), str(second.pid)}
        first.send_signal(signal.SIGKILL)  # no release: the server notices the PID is gone
        first.wait(10)
        wait_for(lambda: {p.name for p in clients.iterdir()} == {str(second.pid)}, 30, "pruning")
        assert psutil.pid_exists(server)  # the second still uses it

        second.communicate("\n", timeout=30)  # released: idle from now on
        assert second.returncode == 0
        psutil.Process(server).wait(30)  # stops by itself after the idle time
        assert not (home / KEPT_DIR / f"{NAME}.json").exists()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        stop_local(home)
