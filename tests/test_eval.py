"""Evaluation in three modes (shared, dedicated, external), the standalone evaluate-policy flow,
and evaluations that fail or hang while training goes on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest
from fastapi import FastAPI
from mlflow.tracking import MlflowClient

from miles_core.config import load_config
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.eval.registry import BEST_EVAL_ALIAS
from miles_core.eval.scoring import EvalSpec, score_policy
from miles_core.processes.identity import children
from miles_core.run.runtime import RLRuntime, prepare_model_dir
from miles_core.run.tracking import NEWEST_POLICY_ALIAS, Tracker
from tests.servers import served


def _config(tmp_path: Path, name: str, *extra: str):
    return load_config(
        None,
        [
            f"name={name}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=6",
            "train.num_steps=4",
            "train.global_batch_size=16",
            "train.micro_batch_size=16",
            "train.lr=3e-3",
            f"checkpoint.root={tmp_path}/ckpt",
            "checkpoint.interval=2",
            "eval.every=2",
            "eval.prompts=8",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            "tracking.experiment=eval",
            *extra,
        ],
    )


def _train(rt: RLRuntime) -> tuple[list[dict], list[tuple[int, dict]]]:
    """The flow's loop without Prefect: (per-step metrics, evaluations as they came back)."""
    steps, evals = [], []
    if rt.eval_due(0):
        rt.submit_evaluation(0)
    for step in range(rt.config.train.num_steps):
        result = rt.rollout(step)
        metrics = result.metrics | rt.train(result) | rt.update_weights()
        if rt.is_save_step(step):
            rt.save(step)
        if rt.eval_due(step + 1):
            rt.submit_evaluation(step + 1)
        evals += rt.finished_evaluations()
        steps.append(metrics)
    evals += rt.finished_evaluations(wait=True)
    return steps, evals


def _runtime(cfg, tmp_path: Path) -> RLRuntime:
    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment, cfg.name)
    return RLRuntime(cfg, prepare_model_dir(cfg, tmp_path / f"init-{cfg.name}"), tracker)


def _assert_scores_of_version(cfg, tmp_path: Path, version: int, got: dict) -> None:
    """`got` has the greedy eval metrics of policy version `version`, computed apart from the
    run: a fresh embedded engine on the weights of that version (the initial model for 0, else
    the checkpoint after step version - 1) and the run's eval spec. (At this size the reward
    is 0 at every version; the lengths and the other metrics are compared as well.)"""
    from miles_core.models import load_hf_dir

    if version == 0:
        model_dir = tmp_path / f"init-{cfg.name}" / "init_model"
    else:
        model_dir = Path(cfg.checkpoint.root) / cfg.name / f"step_{version - 1:06d}"
    model, tok = load_hf_dir(model_dir)
    expected = score_policy(EmbeddedEngine(model, tok, seed=0), tok, EvalSpec.from_run(cfg))
    shared = sorted(set(expected) & set(got))
    assert {"eval/reward_mean", "eval/response_len_mean"} <= set(shared), got
    assert {k: got[k] for k in shared} == {k: expected[k] for k in shared}, version


def _engine_children() -> list[int]:
    """PIDs of engine servers started by this process that are still alive."""

    def cmdline(proc: psutil.Process) -> str:
        try:
            return " ".join(proc.cmdline())
        except psutil.Error:  # gone meanwhile
            return ""

    procs = children(os.getpid())  # live descendants, through psutil
    return [p.pid for p in procs if "miles_core.engines.cpu.server" in cmdline(p)]


def test_an_evaluation_is_deterministic_and_leaves_training_sampling_as_it_was(tiny):
    model, tok = tiny
    engine = EmbeddedEngine(model, tok, seed=3)
    before = engine.generator.get_state()
    spec = EvalSpec(task="reverse", prompts=6, max_new_tokens=8)
    first = score_policy(engine, tok, spec)
    assert score_policy(engine, tok, spec) == first  # greedy on fixed prompts
    assert engine.generator.get_state().equal(before)
    assert first["eval/prompts"] == 6.0 and "eval/exact_match" in first
    assert not any(k.startswith("eval/weight_version") for k in first)


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_shared_mode_scores_each_due_version_without_changing_training(tmp_path):
    runs = {}
    for mode in ("none", "shared"):
        rt = _runtime(_config(tmp_path, f"shared-{mode}", f"eval.mode={mode}"), tmp_path)
        try:
            runs[mode] = _train(rt)
        finally:
            rt.close()
    (plain, no_evals), (steps, evals) = runs["none"], runs["shared"]
    assert no_evals == []
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm")
    assert [[m[k] for k in keys] for m in steps] == [[m[k] for k in keys] for m in plain]
    assert [v for v, _ in evals] == [0, 2, 4]  # the start, every 2 versions, the last
    cfg = _config(tmp_path, "shared-shared", "eval.mode=shared")
    for version, m in evals:
        assert m["eval/policy_version"] == version and m["eval/lag_steps"] == 0.0
        assert m["eval/errors"] == 0.0
        # the score of the weights of that version, not of the version the engine holds now
        _assert_scores_of_version(cfg, tmp_path, version, m)
    assert evals[1][1]["eval/weights_match"] == 1.0  # version 2 = the checkpoint of step 1


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_dedicated_mode_in_the_flow_then_the_evaluate_flow_scores_a_version(
    prefect_server, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    from flows.evaluate import evaluate
    from flows.rl_train import rl_train

    cfg = _config(tmp_path, "dedicated", "eval.mode=dedicated")
    before = set(_engine_children())  # servers of session fixtures (conftest.session_stack)
    rl_train(cfg)
    assert set(_engine_children()) == before  # each dedicated engine stopped after its evaluation

    uri = cfg.tracking.tracking_uri
    client = MlflowClient(uri, registry_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    rid = run.info.run_id
    scores = {m.step: m.value for m in client.get_metric_history(rid, "eval/reward_mean")}
    assert sorted(scores) == [2, 4]  # logged at the versions they measured
    for key in ("eval/weights_match", "eval/errors", "eval/lag_steps"):
        assert len(client.get_metric_history(rid, key)) == 2, key
    assert {m.value for m in client.get_metric_history(rid, "eval/weights_match")} == {1.0}
    assert {m.value for m in client.get_metric_history(rid, "eval/errors")} == {0.0}
    versions = {
        v.tags["policy_version"]: v for v in client.search_model_versions("name='dedicated'")
    }
    assert sorted(versions) == ["2", "4"]
    for pv, v in versions.items():  # each checkpoint carries its score
        assert float(v.tags["eval.reward_mean"]) == scores[int(pv)]
    best = client.get_model_version_by_alias("dedicated", BEST_EVAL_ALIAS)
    assert float(best.tags["eval.reward_mean"]) == max(scores.values())

    # the standalone flow: the newest version (policy version 4), as a nested run
    first = evaluate("dedicated", alias=NEWEST_POLICY_ALIAS, tracking_uri=uri, prompts=8)
    assert first["skipped"] is True  # scored in the run already
    out = evaluate("dedicated", tracking_uri=uri, prompts=8, skip_evaluated=False)
    assert out["policy_version"] == 4 and out["weights_match"] is True
    assert out["eval/reward_mean"] == scores[4]  # the same greedy score, another engine
    nested = client.get_run(out["eval_run_id"])
    assert nested.data.tags["mlflow.parentRunId"] == rid
    assert nested.data.tags["miles.model_version"] == out["version"]
    [point] = client.get_metric_history(nested.info.run_id, "eval/reward_mean")
    assert point.step == 4
    with pytest.raises(LookupError, match="no version 99"):
        evaluate("dedicated", version="99", tracking_uri=uri)


@pytest.fixture
def broken_services():
    """Two evaluation services on 127.0.0.1: one that accepts jobs and never finishes them,
    one that answers every job with HTTP 500."""
    hanging, failing = FastAPI(), FastAPI()
    hanging.post("/evaluations", status_code=202)(lambda: {"id": "j1"})
    hanging.get("/evaluations/{job_id}")(lambda job_id: {"status": "running"})

    @failing.post("/evaluations")
    def refuse():
        from fastapi.responses import JSONResponse

        return JSONResponse({"message": "evaluator out of GPUs"}, status_code=500)

    with served(hanging) as a, served(failing) as b:
        yield [f"{a}/evaluations", f"{b}/evaluations"]


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_external_mode_scores_checkpoints_through_the_service(tmp_path):
    from miles_core.eval.service import EvalServiceProcess

    ckpt = tmp_path / "ckpt"
    service = EvalServiceProcess(log_path=tmp_path / "service.log", checkpoint_roots=[str(ckpt)])
    with service:
        cfg = _config(
            tmp_path,
            "external",
            "eval.mode=external",
            f"eval.mode_options.url={service.evaluations}",
        )
        rt = _runtime(cfg, tmp_path)
        try:
            steps, evals = _train(rt)
        finally:
            rt.close()
    assert len(steps) == 4 and [v for v, _ in evals] == [2, 4]
    for version, m in evals:
        assert m["eval/errors"] == 0.0 and m["eval/weights_match"] == 1.0, m
        assert 0.0 <= m["eval/lag_steps"] <= 4 - version
        _assert_scores_of_version(cfg, tmp_path, version, m)


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_failing_or_hanging_evaluations_never_stop_training(tmp_path, broken_services):
    hanging, failing = broken_services
    cases = {
        "hangs": (
            "eval.mode=external",
            f"eval.mode_options.url={hanging}",
            "eval.timeout_s=2",
            "eval.mode_options.poll_s=0.2",
        ),
        "http500": ("eval.mode=external", f"eval.mode_options.url={failing}"),
        # the engine refuses the evaluation's requests: longer than the model's context
        "raises": ("eval.mode=shared", "eval.max_new_tokens=100000"),
    }
    reasons = {"hangs": "at the timeout", "http500": "evaluator out of GPUs", "raises": "context"}
    for name, extra in cases.items():
        cfg = _config(tmp_path, f"broken-{name}", *extra)
        rt = _runtime(cfg, tmp_path)
        try:
            steps, evals = _train(rt)
            tags = MlflowClient(cfg.tracking.tracking_uri).get_run(rt.tracker.run_id).data.tags
        finally:
            rt.close()
        assert len(steps) == 4, name  # every training step ran
        assert evals and all(m["eval/errors"] == 1.0 for _, m in evals), name
        assert all("eval/reward_mean" not in m for _, m in evals), name
        errors = [t for k, t in tags.items() if k.startswith("eval.v") and k.endswith(".error")]
        assert errors and all(reasons[name] in e for e in errors), (name, errors)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.mode=external"], r"eval.mode_options.url\n +Field required"),
        (
            ["eval.mode_options.url=http://127.0.0.1:1/e"],
            "evaluation mode 'none' takes no options; eval.mode_options has url",
        ),
        (
            ["eval.mode=shared", "eval.mode_options.max_in_flight=3"],
            "evaluation mode 'shared' takes no options",
        ),
        (
            ["eval.mode=dedicated", "eval.every=3", "checkpoint.interval=2"],
            "must be a multiple of checkpoint.interval",
        ),
        (["eval.mode=dedicated", "eval.every=2"], "must be a multiple of checkpoint.interval"),
        (["eval.mode=fast"], "eval.mode"),
        (["eval.prompts=0"], "eval.prompts"),
    ],
)
def test_bad_eval_settings_are_refused_before_anything_starts(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_the_evaluation_service_refuses_malformed_jobs_with_4xx():
    from fastapi.testclient import TestClient

    from miles_core.eval.service import create_app

    client = TestClient(create_app(checkpoint_roots=["/nowhere"]))
    spec = {"task": "say_a", "prompts": 4}
    assert client.post("/evaluations", json={"policy_version": 1, "spec": spec}).status_code == 422
    bad_task = {"checkpoint_uri": "/nowhere", "policy_version": 1, "spec": {"task": "nope"}}
    r = client.post("/evaluations", json=bad_task)
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    assert client.get("/evaluations/unknown").status_code == 404
    # a checkpoint that is not there: the job fails with the reason, the service keeps serving
    job = {"checkpoint_uri": "/nowhere/step_000001", "policy_version": 1, "spec": spec}
    job_id = client.post("/evaluations", json=job).json()["id"]
    for _ in range(200):
        state = client.get(f"/evaluations/{job_id}").json()
        if state["status"] in ("done", "failed"):
            break
        threading.Event().wait(0.05)
    assert state["status"] == "failed" and "not a model directory" in state["error"]
    assert client.get("/health").json()["status"] == "ok"


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_dedicated_scores_carry_the_checkpoints_checksum_with_bf16_pushes(tmp_path):
    """The engine holds bf16-rounded weights, the checkpoint the trainer's: evaluations of the
    checkpoint are compared with the checksum of what the checkpoint holds."""
    extra = ("eval.mode=dedicated", "weight_sync.dtype=bfloat16", "train.num_steps=2")
    rt = _runtime(_config(tmp_path, "bf16", *extra), tmp_path)
    try:
        _, evals = _train(rt)
    finally:
        rt.close()
    assert [(v, m["eval/weights_match"], m["eval/errors"]) for v, m in evals] == [(2, 1.0, 0.0)]


def test_closing_a_background_evaluator_skips_the_jobs_not_started():
    from miles_core.eval.evaluators import BackgroundEvaluator, EvalJob

    started, release = threading.Event(), threading.Event()

    def runner(job, deadline):
        started.set()
        release.wait(10)
        return {"eval/reward_mean": 1.0}, "sha"

    ev = BackgroundEvaluator(runner, timeout_s=10, max_in_flight=2, name="t")
    ev.submit(EvalJob(1))
    started.wait(10)
    ev.submit(EvalJob(2))  # queued behind the running one
    ev.submit(EvalJob(3))  # over max_in_flight: skipped at once
    release.set()
    ev.close()
    outcomes = {o.job.version: o for o in ev.finished()}
    assert outcomes[1].error is None and outcomes[1].metrics == {"eval/reward_mean": 1.0}
    assert "max_in_flight" in outcomes[3].error
    assert outcomes[2].error is None or "run ended" in outcomes[2].error
