"""The rl-train Prefect flow end to end (ephemeral Prefect test server, SQLite MLflow)."""

import pytest
from mlflow.tracking import MlflowClient

from miles_core.config import load_config


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
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
