"""The rl-train Prefect flow end to end (ephemeral Prefect test server, SQLite MLflow)."""

import os
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from miles_core.config import load_config


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_rl_flow_learns_say_a_and_writes_mlflow(prefect_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from flows.rl_train import rl_train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = load_config(
        None,
        [
            "name=flow-test",
            "model.preset=tiny",
            "data.task=say_a",
            "rollout.prompts_per_step=16",
            "rollout.n_samples_per_prompt=8",
            "rollout.max_new_tokens=12",
            "train.num_steps=30",
            "train.global_batch_size=128",
            "train.micro_batch_size=64",
            "train.lr=3e-3",
            f"checkpoint.root={tmp_path}/ckpt",
            "checkpoint.interval=10",
            f"tracking.tracking_uri={uri}",
            "tracking.experiment=flow-test",
        ],
    )
    state = rl_train(config, return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert summary["reward_last5"] > summary["reward_first5"] + 0.3

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])[0]
    assert run.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    assert run.data.params["train.lr"] == "0.003"
    assert run.info.status == "FINISHED"
    for key in (
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/response_len_mean",
        "rollout/truncated_ratio",
        "rollout/tokens_per_s",
        "rollout/weight_version/mean",
        "train/loss",
        "train/pg_loss",
        "train/entropy",
        "train/pg_clipfrac",
        "train/ppo_kl",
        "train/grad_norm",
        "train/lr",
        "train/train_rollout_logprob_abs_diff",
        "perf/step_time_s",
        "perf/rollout_time_s",
        "perf/train_time_s",
        "perf/weight_sync_time_s",
        "perf/weight_sync_bytes",
        "perf/orchestration_time_s",
    ):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == list(range(30)), key
    kl = client.get_metric_history(run.info.run_id, "train/ppo_kl")
    assert all(m.value == 0.0 for m in kl)  # one optimizer step per rollout: exactly on-policy
    versions = client.get_metric_history(run.info.run_id, "rollout/weight_version/mean")
    assert [m.value for m in versions] == [
        float(s) for s in range(30)
    ]  # the engine runs version = step

    # checkpoints at steps 9, 19, 29 are registered policy versions tied to their step
    mvs = sorted(client.search_model_versions("name='flow-test'"), key=lambda mv: int(mv.version))
    assert [(mv.tags["step"], mv.tags["policy_version"]) for mv in mvs] == [
        ("9", "10"),
        ("19", "20"),
        ("29", "30"),
    ]
    assert mvs[-1].source == f"{tmp_path}/ckpt/flow-test/step_000029"
    assert client.get_model_version_by_alias("flow-test", "newest").version == mvs[-1].version
    assert "reward_curve.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.info.artifact_uri.startswith((tmp_path / "mlruns").as_uri())  # beside the DB
    assert summary["mlflow_run_id"] == run.info.run_id
    # sync mode's shape: the steps inside one long-running train_loop, no task run per step
    tasks = _task_run_names(state.state_details.flow_run_id)
    assert tasks.count("train_loop") == 1 and not {"rollout_batch", "train_step"} & set(tasks)


def _tiny_config(tmp_path, name, steps, extra=()):
    return load_config(
        None,
        [
            f"name={name}",
            "model.preset=tiny",
            "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            f"train.num_steps={steps}",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.lr=3e-3",
            f"checkpoint.root={tmp_path}/ckpt",
            "checkpoint.interval=2",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            "tracking.experiment=resume",
            *extra,
        ],
    )


def _histories(client, run_id, keys):
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


SERVER = [
    "rollout.engine=server",
    "rollout.engine_options.threads=1",
    "weight_sync.check_equal=true",
]
KEYS = [
    "rollout/reward_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "rollout/weight_version/mean",
]


def _runs(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("resume").experiment_id
    return client, {r.info.run_name: r for r in client.search_runs([exp])}


def _assert_engine_gauges(client, run_id, steps):
    """An engine that shares prefixes: GRPO siblings reuse the prompt's KV, gauges every step."""
    hit = [m.value for m in client.get_metric_history(run_id, "rollout/prefix_cache_hit_rate")]
    assert len(hit) == steps and min(hit) > 0.5
    for gauge in ("rollout/engine_active_requests", "rollout/engine_queue_depth"):
        assert len(client.get_metric_history(run_id, gauge)) == steps, gauge


def _resume(tmp_path, extra, full_steps, part_steps):
    """A run of `part_steps` steps (checkpoints every 2), then `--resume` to `full_steps`."""
    from flows.rl_train import rl_train

    rl_train(_tiny_config(tmp_path, "part", part_steps, extra))
    rl_train(_tiny_config(tmp_path, "part", full_steps, extra), resume=True)


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.parametrize("engine", ["embedded", "serving"])
def test_resume_continues_the_same_run_bit_identically(
    prefect_server, tmp_path, monkeypatch, engine
):
    monkeypatch.chdir(tmp_path)
    from flows.rl_train import rl_train

    extra = [f"rollout.engine={engine}"]
    rl_train(_tiny_config(tmp_path, "full", 6, extra))
    _resume(tmp_path, extra, 6, 4)  # checkpoints after steps 1 and 3

    client, runs = _runs(tmp_path)
    assert set(runs) == {"full", "part"}  # the resumed job re-attached to its MLflow run
    assert runs["part"].data.tags["miles.resume.train.num_steps"] == "6"
    if engine != "embedded":
        _assert_engine_gauges(client, runs["full"].info.run_id, 6)
    full = _histories(client, runs["full"].info.run_id, KEYS)
    part = _histories(client, runs["part"].info.run_id, KEYS)
    for k in KEYS:
        assert [s for s, _ in part[k]] == list(range(6)), k
        assert part[k] == full[k], k  # bit-identical, steps 4 and 5 included


SERVER_STEPS = 3


@pytest.fixture(scope="module")
def server_reference(prefect_server, tmp_path_factory, mlflow_template):
    """One uninterrupted sync run on an engine server, the reference of every transport's
    resume below. A push is bitwise (weight_sync.check_equal), so in sync mode a run's metrics
    do not depend on the transport that carried its weights: a transport that changed them
    fails its comparison with this reference."""
    from flows.rl_train import rl_train

    tmp = tmp_path_factory.mktemp("server-reference")
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")
    extra = [*SERVER, "weight_sync.transport=shared_memory"]
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        rl_train(_tiny_config(tmp, "full", SERVER_STEPS, extra))
    finally:
        os.chdir(cwd)
    client, runs = _runs(tmp)
    run_id = runs["full"].info.run_id
    _assert_engine_gauges(client, run_id, SERVER_STEPS)
    return _histories(client, run_id, KEYS)


# one invocation (step) each; broadcast forms its group as p2p does (group_transport.py), and
# its pushes into a fresh engine server are bitwise in test_transports.py
RESUME_CHAIN = ["shared_memory", "disk", "p2p"]


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_resume_on_an_engine_server_continues_the_same_run_bit_identically(
    prefect_server, server_reference, tmp_path, monkeypatch
):
    """One run, stopped after every step and resumed on a new engine server through the next
    transport (a resume may change `weight_sync.transport`): each transport's first push to a
    fresh engine and its pushes after it give the reference run's metrics bit for bit."""
    from flows.rl_train import rl_train

    monkeypatch.chdir(tmp_path)
    assert len(RESUME_CHAIN) == SERVER_STEPS
    for steps, transport in enumerate(RESUME_CHAIN, start=1):
        extra = [*SERVER, f"weight_sync.transport={transport}"]
        rl_train(_tiny_config(tmp_path, "part", steps, extra), resume=steps > 1)

    client, runs = _runs(tmp_path)
    assert set(runs) == {"part"}  # every resumed invocation re-attached to its MLflow run
    assert runs["part"].data.tags["miles.resume.train.num_steps"] == str(SERVER_STEPS)
    _assert_engine_gauges(client, runs["part"].info.run_id, SERVER_STEPS)
    part = _histories(client, runs["part"].info.run_id, KEYS)
    for k in KEYS:
        assert [s for s, _ in part[k]] == list(range(SERVER_STEPS)), k
        assert part[k] == server_reference[k], k  # bit-identical, every resumed step


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_sft_warm_start_is_a_nested_run_and_feeds_rl(prefect_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from flows.rl_train import rl_train

    warm_start = [
        "data.task=reverse",
        "sft.task=reverse",
        "sft.num_steps=20",
        "sft.batch_size=16",
        "sft.micro_batch_size=8",
        "sft.lr=3e-3",
    ]
    rl_train(_tiny_config(tmp_path, "warm", 1, warm_start))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("resume").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([exp])}
    sft_run, rl_run = runs["warm-sft"], runs["warm"]
    assert sft_run.data.tags["mlflow.parentRunId"] == rl_run.info.run_id
    loss = [m.value for m in client.get_metric_history(sft_run.info.run_id, "sft/loss")]
    assert len(loss) == 20 and loss[-1] < loss[0]
    assert (
        rl_run.data.params["model.path"] == "None"
    )  # the flow param; the RL run started from the SFT output
    saved = tmp_path / "ckpt" / "warm-sft" / "step_000020"
    assert (saved / "model.safetensors").exists()

    # another run reuses that warm start (sft.reuse): no SFT of its own, the same first step
    rl_train(_tiny_config(tmp_path, "again", 1, [*warm_start, f"sft.reuse={saved}"]))
    runs = {r.info.run_name: r for r in client.search_runs([exp])}
    assert "again-sft" not in runs and not (tmp_path / "ckpt" / "again-sft").exists()
    first = {
        name: _histories(client, runs[name].info.run_id, ["rollout/reward_mean", "train/loss"])
        for name in ("warm", "again")
    }
    assert first["again"] == first["warm"]


LOOP_NAMES = ("rollout_loop", "train_loop", "weight_update_loop", "evaluation_loop")


def _task_runs(flow_run_id) -> list:
    """The flow run's task runs, read back from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )


def _task_run_names(flow_run_id) -> list[str]:
    """The task names of the flow run's task runs (a run's name is `<task>-<suffix>`)."""
    return [r.name.rsplit("-", 1)[0] for r in _task_runs(flow_run_id)]


def _loop_runs(flow_run_id) -> dict:
    """The flow run's long-running task runs by task name."""
    runs = _task_runs(flow_run_id)
    return {r.name.rsplit("-", 1)[0]: r for r in runs if r.name.rsplit("-", 1)[0] in LOOP_NAMES}


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_fully_async_flow_logs_staleness_within_the_bound(prefect_server, tmp_path, monkeypatch):
    """Also: each push overlaps the next train step (tests/plugins/overlap.py holds the push of
    version 1 until the trainer steps again) and is checked bitwise against its snapshot."""
    monkeypatch.chdir(tmp_path)
    from flows.rl_train import rl_train
    from tests.plugins import overlap

    overlap.HELD.clear()
    extra = [*SERVER, "rollout.mode=fully_async"]
    extra += [
        "train.backend=tests.plugins.overlap:SteppingBackend",
        "weight_sync.transport=tests.plugins.overlap:HeldPush",
    ]
    extra += ["eval.mode=shared", "eval.every=3", "eval.prompts=4"]  # the evaluation loop too
    state = rl_train(_tiny_config(tmp_path, "async", 6, extra), return_state=True)
    assert state.is_completed()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("resume").experiment_id])[0]
    worst = client.get_metric_history(run.info.run_id, "rollout/staleness/max")
    assert len(worst) == 6 and max(m.value for m in worst) <= 1
    for key in ("rollout/weight_version/mixed_version_ratio", "buffer/size"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 6, key
    evals = client.get_metric_history(run.info.run_id, "eval/policy_version")
    assert sorted((m.step, m.value) for m in evals) == [(0, 0.0), (3, 3.0), (6, 6.0)]
    assert overlap.HELD == [1]  # released by a train step taken while it was pushed
    # the run's shape: the long-running task runs with work beside the trainer (producer,
    # overlapped pushes; the shared evaluation runs between steps), Running at once, completed
    loops = _loop_runs(state.state_details.flow_run_id)
    assert sorted(loops) == ["rollout_loop", "train_loop", "weight_update_loop"]
    assert {r.state_type.value for r in loops.values()} == {"COMPLETED"}
    assert max(r.start_time for r in loops.values()) < min(r.end_time for r in loops.values())


# a run on an engine server whose reward function (tests/scripts/failing_task.py) stops it at the
# second rollout
FAILS_ON_SECOND_ROLLOUT = [
    *SERVER,
    "weight_sync.transport=shared_memory",
    "data.task=failing_task:FailsOnSecondRollout",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=2",
    "train.global_batch_size=8",
]


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_a_failing_run_stops_its_engine_server(prefect_server, tmp_path, monkeypatch):
    import os
    import subprocess

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "scripts"))
    from flows.rl_train import rl_train

    extra = FAILS_ON_SECOND_ROLLOUT

    def engine_children() -> set[str]:
        pgrep = ["pgrep", "-P", str(os.getpid()), "-f", "miles_core.engines.cpu.server"]
        return set(subprocess.run(pgrep, capture_output=True, text=True).stdout.split())

    before = engine_children()  # servers of session fixtures (conftest.session_stack)
    with pytest.raises(SystemExit, match="reward function stopped the run"):
        rl_train(_tiny_config(tmp_path, "fails", 4, extra))
    assert engine_children() == before  # stopped by PID in the flow's finally, not left running


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_a_failing_long_running_task_fails_the_run_and_ends_the_others(
    prefect_server, tmp_path, monkeypatch
):
    """fully_async: the reward raises inside the producer's loop at the second step; the run
    fails with it, every other loop returns (none left Running), MLflow says FAILED."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "scripts"))
    from flows.rl_train import rl_train

    extra = [*FAILS_ON_SECOND_ROLLOUT, "rollout.mode=fully_async"]
    state = rl_train(_tiny_config(tmp_path, "fails-async", 4, extra), return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="rollout producer failed.*reward function stopped"):
        state.result()
    loops = _loop_runs(state.state_details.flow_run_id)
    assert sorted(loops) == sorted(LOOP_NAMES[:3])  # no evaluation configured: no eval loop
    states = {name: r.state_type.value for name, r in loops.items()}
    assert "FAILED" in states.values() and set(states.values()) <= {"FAILED", "COMPLETED"}
    client, runs = _runs(tmp_path)
    assert runs["fails-async"].info.status == "FAILED"
