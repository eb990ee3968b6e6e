"""Tests for miles_core.run.tracking against a real SQLite-backed MLflow store (no mocks)."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from miles_core.run.tracking import (
    NEWEST_POLICY_ALIAS,
    Tracker,
    flatten_params,
    resolve_tracking_uri,
)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite DB for the module: creating the schema takes seconds, so do it once."""
    db_dir = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{db_dir}/mlflow.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(db_dir)
        MlflowClient(tracking_uri=uri).search_experiments()  # creates the tables
    return uri


@pytest.fixture
def make_tracker(tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request):
    """Build Trackers in a per-test experiment with the cwd in tmp_path.

    Run artifacts land under the module DB dir: MLflow caches the SQL store per URI and resolves
    its default artifact root (./mlruns) against the cwd once, when the store is first built.
    """
    monkeypatch.chdir(tmp_path)

    def make(**kwargs) -> Tracker:
        kwargs.setdefault("run_name", "run")
        return Tracker(tracking_uri=tracking_uri, experiment=request.node.name, **kwargs)

    return make


def test_flatten_params() -> None:
    flat = flatten_params(
        {
            "train": {"lr": 0.001, "opt": {"betas": (0.9, 0.95)}},
            "none": None,
            "list": [1, 2],
            "empty": {},
            "bad key!": {"a=b": 1},
            "long": "x" * 7000,
        }
    )
    assert flat == {
        "train.lr": "0.001",
        "train.opt.betas": "(0.9, 0.95)",
        "none": "None",
        "list": "[1, 2]",
        "empty": "{}",
        "bad key_.a_b": "1",
        "long": "x" * 6000,
    }
    assert flatten_params({"a": 1}, prefix="cfg") == {"cfg.a": "1"}


def test_credentials_in_the_config_never_reach_mlflow_params() -> None:
    """S3 storage options and API keys are logged as `<redacted>`; look-alike names are not."""
    from miles_core.run.tracking import REDACTED

    config = {
        "checkpoint": {
            "storage_options": {
                "endpoint_url": "http://127.0.0.1:9000",
                "key": "AKIA-test",
                "secret": "s3cr3t",
                "aws_secret_access_key": "s3cr3t",
                "session_token": "tok",
                "client_kwargs": {"region_name": "eu"},
            }
        },
        "network": {"api_key": "k", "port_range": None},
        "agent": {"max_tokens": 5, "token_budget": 4, "api_key": None},
    }
    flat = flatten_params(config)
    secrets = {k for k, v in flat.items() if v == REDACTED}
    assert secrets == {
        "checkpoint.storage_options.key",
        "checkpoint.storage_options.secret",
        "checkpoint.storage_options.aws_secret_access_key",
        "checkpoint.storage_options.session_token",
        "network.api_key",
    }
    assert not any(s in v for v in flat.values() for s in ("AKIA-test", "s3cr3t", "tok"))
    assert flat["checkpoint.storage_options.endpoint_url"] == "http://127.0.0.1:9000"
    assert flat["agent.token_budget"] == "4" and flat["agent.api_key"] == "None"


def test_params_flattened_and_logged(make_tracker) -> None:
    params = {"train": {"lr": 0.001, "batch": 8}, "model": "tiny", "extra": {}}
    params.update({f"k{i}": i for i in range(150)})  # > 100 params: several log_batch calls
    tracker = make_tracker(params=params, tags={"team": "rl"})

    run = tracker.client.get_run(tracker.run_id)
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.params["train.batch"] == "8"
    assert run.data.params["model"] == "tiny"
    assert run.data.params["extra"] == "{}"
    assert run.data.params["k149"] == "149"
    assert len(run.data.params) == 154
    assert run.data.tags["team"] == "rl"
    assert run.data.tags["mlflow.runName"] == "run"
    assert run.info.run_name == "run"
    assert run.info.experiment_id == tracker.experiment_id


def test_metrics_buffered_until_flush(make_tracker) -> None:
    tracker = make_tracker()
    client = tracker.client
    for step in range(3):
        tracker.log_metrics(
            {
                "loss": 1.0 / (step + 1),
                "rollout/reward_mean": 0.1 * step,
                "skipped_none": None,  # type: ignore[dict-item]
                "skipped_nan": math.nan,
                "skipped_inf": math.inf,
            },
            step=step,
        )

    assert client.get_metric_history(tracker.run_id, "loss") == []
    assert client.get_metric_history(tracker.run_id, "rollout/reward_mean") == []

    tracker.flush()
    for key, expected in [
        ("loss", [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]),
        ("rollout/reward_mean", [(0, 0.0), (1, 0.1 * 1), (2, 0.1 * 2)]),
    ]:
        got = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, key))
        assert got == expected  # floats round-trip exactly through SQLite
        assert tracker.history(key) == expected
    for key in ("skipped_none", "skipped_nan", "skipped_inf"):
        assert client.get_metric_history(tracker.run_id, key) == []
        assert tracker.history(key) == []

    tracker.flush()  # buffer was cleared: nothing is logged twice
    assert len(client.get_metric_history(tracker.run_id, "loss")) == 3


def test_flush_if_due_batches_steps_within_the_interval_and_raises_in_the_caller(
    make_tracker,
) -> None:
    """`flush_if_due` (the step loop's): nothing is sent until `flush_interval_s` has passed
    since the last write, then every buffered step at once, in order; interval 0 sends every
    step; a refused write raises in the caller; `finish` sends the rest."""
    tracker = make_tracker()
    tracker.flush_interval_s = 3600.0
    history = lambda: [  # noqa: E731
        (m.step, m.value) for m in tracker.client.get_metric_history(tracker.run_id, "loss")
    ]
    for step in range(3):
        tracker.log_metrics({"loss": float(step)}, step=step)
        assert tracker.flush_if_due() is False
    assert history() == []  # buffered: the interval has not passed
    tracker.flush_interval_s = 0.0
    tracker.log_metrics({"loss": 3.0}, step=3)
    assert tracker.flush_if_due() is True
    assert history() == [(s, float(s)) for s in range(4)]
    tracker.log_metrics({"bad key!": 1.0}, step=4)  # MLflow refuses the name
    with pytest.raises(MlflowException, match="bad key!"):
        tracker.flush_if_due()
    tracker.flush_interval_s = 3600.0
    tracker.log_metrics({"loss": 9.0}, step=9)
    tracker.finish()  # the buffered step is sent, then the run ends
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] == 9.0


def test_a_flush_on_another_thread_loses_no_metric_being_logged(make_tracker) -> None:
    """The async modes log from the train loop and the evaluation loop at once: a flush on one
    thread in the middle of another thread's `log_metrics` sends the metric then or with the
    next flush, never drops it (appended to the buffer the flush had already taken)."""
    tracker = make_tracker()
    flusher = threading.Thread(target=tracker.flush)

    class Racing(list):
        def append(self, item) -> None:
            if flusher.ident is None:  # the first append: a flush starts on another thread
                flusher.start()
                # unguarded, it swaps the buffer and returns at once; behind the buffer's lock
                # it waits for this append (the timeout only ends the wait for it)
                flusher.join(timeout=0.5)
            super().append(item)

    tracker._buffer = Racing()
    tracker.log_metrics({"loss": 1.0}, step=0)
    flusher.join()
    tracker.flush()
    history = tracker.client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0)]


def test_log_policy_version(make_tracker, tmp_path: Path) -> None:
    tracker = make_tracker()
    client = tracker.client
    model = "policy-test"
    local_ckpt = tmp_path / "checkpoints" / "step_000001"
    local_ckpt.mkdir(parents=True)

    v1 = tracker.log_policy_version(model, step=1, policy_version=1, source_uri=str(local_ckpt))
    s3_source = "s3://bucket/x/step_000002"
    v2 = tracker.log_policy_version(
        model, step=2, policy_version=2, source_uri=s3_source, tags={"note": "second"}
    )
    assert (v1, v2) == ("1", "2")

    mv1 = client.get_model_version(model, v1)
    assert mv1.source == str(local_ckpt)
    assert mv1.run_id == tracker.run_id
    assert mv1.tags == {"step": "1", "policy_version": "1"}

    mv2 = client.get_model_version(model, v2)
    assert mv2.source == s3_source
    assert mv2.tags == {"step": "2", "policy_version": "2", "note": "second"}

    newest = client.get_model_version_by_alias(model, NEWEST_POLICY_ALIAS)
    assert str(newest.version) == "2"
    assert client.get_run(tracker.run_id).data.tags["miles.policy_version"] == "2"


def test_log_reward_curve(make_tracker, tmp_path: Path) -> None:
    tracker = make_tracker(run_name="curve-run")
    for step in range(5):
        tracker.log_metrics(
            {"rollout/reward_mean": step / 4, "eval/gsm8k/exact_match": step / 8}, step=step
        )

    path = tracker.log_reward_curve(also_to=tmp_path / "plots")
    assert path.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "plots" / "reward_curve.png").read_bytes() == path.read_bytes()
    artifacts = [a.path for a in tracker.client.list_artifacts(tracker.run_id)]
    assert "reward_curve.png" in artifacts

    tracker.log_dict_artifact({"a": 1}, "summary.json")
    artifacts = [a.path for a in tracker.client.list_artifacts(tracker.run_id)]
    assert "summary.json" in artifacts

    assert path.parent.name.startswith("miles-mlflow-")
    tracker.finish()  # the local copy of the plot goes with the run
    assert not path.parent.exists()


def test_nested_run_and_finish(make_tracker) -> None:
    parent = make_tracker(run_name="parent")
    child = make_tracker(run_name="child", parent_run_id=parent.run_id)
    child.log_metrics({"loss": 0.5}, step=1)
    child.finish()
    parent.finish()

    client = parent.client
    child_run = client.get_run(child.run_id)
    assert child_run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert child_run.info.status == "FINISHED"
    assert child_run.info.end_time is not None
    assert [(m.step, m.value) for m in client.get_metric_history(child.run_id, "loss")] == [
        (1, 0.5)
    ]
    assert client.get_run(parent.run_id).info.status == "FINISHED"
    assert "mlflow.parentRunId" not in client.get_run(parent.run_id).data.tags


def test_reattach_to_run(make_tracker) -> None:
    first = make_tracker(params={"lr": 0.1})
    first.finish(status="FAILED")
    assert first.client.get_run(first.run_id).info.status == "FAILED"

    resumed = make_tracker(params={"lr": 0.1}, run_id=first.run_id)
    assert resumed.run_id == first.run_id
    assert resumed.experiment_id == first.experiment_id
    assert resumed.client.get_run(first.run_id).info.status == "RUNNING"
    resumed.finish()
    assert resumed.client.get_run(first.run_id).info.status == "FINISHED"


def test_resolve_tracking_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert resolve_tracking_uri("sqlite:////explicit.db") == "sqlite:////explicit.db"
    assert resolve_tracking_uri(None) == "http://mlflow.example:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_training_success_is_logged_as_a_9_step_average_across_a_resume(make_tracker) -> None:
    """`rollout/success_rate_ma9` at step s: the mean of steps s-8..s, the steps a killed run
    logged before its resume included (reloaded from MLflow), a step it runs again counted once
    with its new value."""
    from miles_core.run.progress import LogReporter
    from miles_core.run.steplog import StepLog

    killed = [0.0, 0.5, 0.25, 1.0, 0.0, 0.75, 0.5, 0.25, 1.0, 0.0, 0.5]  # steps 0-10
    rerun = {9: 0.75, 10: 0.25, 11: 0.75, 12: 0.5}  # resumed from step 8's checkpoint

    def steps(tracker, values: dict[int, float]) -> None:
        log = StepLog(tracker, LogReporter(), 13)
        for s, v in values.items():
            log.step(s, 0.0, {"rollout/reward_mean": 0.0, "rollout/success_rate": v})
        tracker.flush()

    first = make_tracker()
    steps(first, dict(enumerate(killed)))
    first.finish(status="KILLED")
    resumed = make_tracker(run_id=first.run_id)
    steps(resumed, rerun)
    resumed.finish()
    final = killed[:9] + list(rerun.values())
    want = {s: sum(final[max(0, s - 8) : s + 1]) / len(final[max(0, s - 8) : s + 1]) for s in rerun}
    history = resumed.client.get_metric_history(first.run_id, "rollout/success_rate_ma9")
    got = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # newest wins
    assert sorted(got) == list(range(13))
    assert {s: got[s] for s in rerun} == pytest.approx(want, abs=1e-12)
    assert got[12] != pytest.approx(sum(rerun.values()) / 4)  # not the resumed steps alone


def test_artifacts_land_beside_a_new_sqlite_store_or_where_the_config_says(tmp_path, monkeypatch):
    """Whatever the directory a run starts in: with `sqlite:////abs/path.db` the artifacts of
    a new experiment and of the store's `Default` experiment (where evaluations of a version
    with no run go) are under `<db folder>/mlruns`; `tracking.artifact_location` moves them."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    for experiment in ("mine", "Default"):
        Tracker(uri, experiment, "run").log_dict_artifact({"a": 1}, "a.json")
    found = sorted(p.relative_to(tmp_path).parts[:3] for p in tmp_path.rglob("a.json"))
    assert found == [("store", "mlruns", "0"), ("store", "mlruns", "mine")]  # "0": Default
    assert list(elsewhere.iterdir()) == []

    there = tmp_path / "artifacts"
    uri = f"sqlite:///{tmp_path}/other.db"
    Tracker(uri, "mine", "run", artifact_location=str(there)).log_dict_artifact({}, "b.json")
    [b] = list(tmp_path.rglob("b.json"))
    assert b.is_relative_to(there / "mine")
    assert list(elsewhere.iterdir()) == []
