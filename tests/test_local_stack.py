"""The local production stack end to end: `local-stack up` (Prefect server, MLflow server, moto
S3 on free ports), `deployments/serve.py` serving the training and the scheduled evaluation
deployments, a training run triggered through the Prefect REST API as the UI does, and the
scheduled evaluation's score in MLflow, tied to the registered version it measured. Every
process started here is stopped by PID, and the teardown checks that none survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from infra.processes import (
    api_call,
    descendants,
    group_members,
    pid_alive,
    stop_serving_process,
    tail,
)
from infra.processes import wait_for as _wait_for
from miles_core.processes.managed import free_port

REPO = Path(__file__).resolve().parents[1]
STACK = [str(REPO / "infra" / "local-stack")]
EVAL_INTERVAL_S = 10
MODEL = "stack-e2e"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _stack(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*STACK, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )


@pytest.fixture
def stack(tmp_path_factory):
    """`local-stack up` in a tmp state dir on free ports; `down` in teardown, no PID left."""
    state = tmp_path_factory.mktemp("stack")
    env = {
        **os.environ,
        "MILES_STACK_DIR": str(state),
        "MILES_STACK_PREFECT_PORT": str(free_port()),
        "MILES_STACK_MLFLOW_PORT": str(free_port()),
        "MILES_STACK_S3_PORT": str(free_port()),
    }
    env.pop("PREFECT_API_URL", None)
    t0 = time.monotonic()
    started = _stack(env, "up")
    records = [json.loads(p.read_text()) for p in (state / "pids").glob("*.json")]
    try:
        assert started.returncode == 0, started.stderr + started.stdout
        print(f"stack up in {time.monotonic() - t0:.1f} s\n{started.stdout}")
        client_env = dict(
            line.removeprefix("export ").split("=", 1)
            for line in (state / "env").read_text().splitlines()
        )
        yield {"state": state, "env": env, "client_env": client_env, "records": records}
    finally:
        pids = [r["pid"] for r in records]
        members = [m for pid in pids for m in group_members(pid)]
        stopped = _stack(env, "down")
        assert stopped.returncode == 0, stopped.stderr
        survivors = [p for p in {*pids, *members} if pid_alive(p)]
        assert not survivors, f"processes survive `local-stack down`: {survivors}"
        assert not list((state / "pids").glob("*.json"))  # records removed


@pytest.fixture
def served(stack, tmp_path_factory):
    """`python deployments/serve.py` against the stack; stopped by PID (its flow runs too)."""
    home = tmp_path_factory.mktemp("serve")
    env = {
        **stack["env"],
        **stack["client_env"],
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # default 10 s
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    log_path = home / "serve.log"
    argv = [
        sys.executable,
        str(REPO / "deployments" / "serve.py"),
        "--model",
        MODEL,
        "--interval",
        str(EVAL_INTERVAL_S),
        "--eval-prompts",
        "8",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home, start_new_session=True
        )
    api = stack["client_env"]["PREFECT_API_URL"]
    seen: set[int] = set()
    try:

        def registered():
            assert proc.poll() is None, f"serve.py exited:\n{tail(log_path)}"
            ids = {}
            for name in ("rl-train/train", "evaluate-policy/scheduled"):
                r = api_call("GET", f"{api}/deployments/name/{name}", timeout=10)
                if r.status_code != 200:
                    return None
                ids[name] = r.json()["id"]
            return ids

        ids = _wait_for(registered, 90, "serve.py to register both deployments")
        yield {"api": api, "ids": ids, "log": log_path, "proc": proc, "seen": seen}
    finally:
        stop_serving_process(proc, seen)
        _wait_for(lambda: not any(pid_alive(p) for p in seen), 15, "served flow runs to exit")


def _flow_run(api: str, run_id: str) -> dict:
    return api_call("GET", f"{api}/flow_runs/{run_id}", timeout=10).json()


def _runs_of(api: str, deployment_id: str) -> list[dict]:
    body = {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "limit": 200}
    return api_call("POST", f"{api}/flow_runs/filter", json=body, timeout=10).json()


def _tiny_config(s3_url: str, tracking_uri: str) -> dict:
    return {
        "name": MODEL,
        "model": {"preset": "tiny"},
        "data": {"task": "say_a"},
        "rollout": {"prompts_per_step": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        "train": {"num_steps": 4, "global_batch_size": 16, "micro_batch_size": 16},
        "checkpoint": {
            "root": "s3://miles/ckpt",
            "interval": 2,
            "storage_options": {"endpoint_url": s3_url, "key": "testing", "secret": "testing"},
        },
        "tracking": {"tracking_uri": tracking_uri, "experiment": MODEL},
    }


@pytest.mark.slow
def test_training_deployment_and_scheduled_evaluation_on_the_local_stack(stack, served):
    env, api = stack["client_env"], served["api"]

    # status: every service up at its URL; a second `up` starts nothing new
    status = json.loads(_stack(stack["env"], "status", "--json").stdout)
    assert {s: v["state"] for s, v in status.items()} == {
        s: "up" for s in ("s3", "prefect", "mlflow")
    }
    assert status["mlflow"]["url"] == env["MLFLOW_TRACKING_URI"]
    again = _stack(stack["env"], "up")
    assert again.returncode == 0 and again.stdout.count("already running") == 3
    assert {r["pid"] for r in stack["records"]} == {v["pid"] for v in status.values()}

    # trigger the training deployment as the UI's "Custom run" does
    t0 = time.monotonic()
    config = _tiny_config(env["AWS_ENDPOINT_URL"], env["MLFLOW_TRACKING_URI"])
    created = api_call(
        "POST",
        f"{api}/deployments/{served['ids']['rl-train/train']}/create_flow_run",
        json={"parameters": {"config": config}},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    def finished():
        served["seen"].update(descendants(served["proc"].pid))
        state = _flow_run(api, run_id)["state"]
        return state if state["type"] in TERMINAL else None

    state = _wait_for(finished, 150, "the training flow run")
    assert state["type"] == "COMPLETED", f"{state}\n{tail(served['log'], 60)}"
    print(f"training run completed {time.monotonic() - t0:.1f} s after the trigger")

    # MLflow: the run, and its checkpoints (on S3) as registered versions with `newest`
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(MODEL).experiment_id
    (train_run,) = client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{run_id}'")
    assert train_run.info.status == "FINISHED"
    versions = {mv.version: mv for mv in client.search_model_versions(f"name='{MODEL}'")}
    assert {(mv.tags["step"], mv.source) for mv in versions.values()} == {
        ("1", f"s3://miles/ckpt/{MODEL}/step_000001"),
        ("3", f"s3://miles/ckpt/{MODEL}/step_000003"),
    }
    newest = client.get_model_version_by_alias(MODEL, "newest")
    assert newest.tags["step"] == "3" and newest.run_id == train_run.info.run_id

    # the scheduled evaluation scores the newest version: a nested run of the training run
    def scored():
        served["seen"].update(descendants(served["proc"].pid))
        mv = client.get_model_version(MODEL, newest.version)
        return mv if "eval.reward_mean" in mv.tags else None

    scored_mv = _wait_for(scored, 120, f"a score on version {newest.version}", poll=1)
    print(f"newest version scored {time.monotonic() - t0:.1f} s after the trigger")
    evals = client.search_runs([experiment], f"tags.`miles.model_version` = '{newest.version}'")
    assert evals, "no evaluation run for the newest version"
    for ev in evals:
        assert ev.data.tags["mlflow.parentRunId"] == train_run.info.run_id
        assert ev.data.tags["miles.policy_version"] == scored_mv.tags["policy_version"]
        assert ev.data.tags["miles.weights_sha256"] == scored_mv.tags["weights_sha256"]
        history = client.get_metric_history(ev.info.run_id, "eval/reward_mean")
        assert [m.step for m in history] == [int(scored_mv.tags["policy_version"])]
    assert float(scored_mv.tags["eval.reward_mean"]) in {
        client.get_metric_history(ev.info.run_id, "eval/reward_mean")[0].value for ev in evals
    }

    # ... and it ran as a flow run of the scheduled deployment
    def completed_eval_runs():
        runs = _runs_of(api, served["ids"]["evaluate-policy/scheduled"])
        return [r for r in runs if r["state"]["type"] == "COMPLETED"] and runs

    eval_runs = _wait_for(completed_eval_runs, 30, "a completed evaluation flow run")
    assert all(r["auto_scheduled"] for r in eval_runs)  # started by the schedule, not by us


# -- fast checks without servers ---------------------------------------------------------------


def _cfg(tmp_path, **ports):
    from infra.local_stack import StackConfig

    return StackConfig(tmp_path / "state", **ports)


def test_down_and_status_with_nothing_running(tmp_path):
    from infra import local_stack

    cfg = _cfg(tmp_path)
    lines: list[str] = []
    local_stack.down(cfg, log=lines.append)
    local_stack.down(cfg, log=lines.append)  # twice: still fine
    assert lines == ["nothing running", "nothing running"]
    assert {v["state"] for v in local_stack.status(cfg).values()} == {"down"}


def test_a_stale_record_is_not_taken_for_a_running_service(tmp_path):
    """A record whose PID is gone, or now belongs to another program, reads as down; `down`
    removes it and signals nothing."""
    from infra import local_stack
    from infra.processes import ProcessRecord

    cfg = _cfg(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ProcessRecord("s3", dead.pid, 1, 1, "http://x", "http://x/h", "log", ["x"]).save(cfg.pids)
    # our own PID with a wrong start time: a reused PID must not be stopped
    ProcessRecord("prefect", os.getpid(), 1, 2, "http://y", "http://y/h", "log", ["y"]).save(
        cfg.pids
    )
    report = local_stack.status(cfg)
    assert report["s3"]["state"] == report["prefect"]["state"] == "down"
    lines: list[str] = []
    local_stack.down(cfg, log=lines.append)
    assert lines == [
        f"prefect: not running (pid {os.getpid()})",
        f"s3: not running (pid {dead.pid})",
    ]
    assert not list(cfg.pids.glob("*.json"))


def test_up_refuses_a_port_held_by_another_process(tmp_path):
    import socket

    from infra import local_stack
    from infra.processes import ServiceError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServiceError, match=rf"s3: port {port} .* in use.*--s3-port"):
            local_stack.up(_cfg(tmp_path, s3_port=port), log=lambda _: None)
    assert not list(_cfg(tmp_path).pids.glob("*.json"))  # nothing started, nothing recorded
