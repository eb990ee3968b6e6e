"""Fully asynchronous RL on an engine server: bounded staleness, pushes during generation that
lose nothing, and the same prompts in the same order as a sync run (no length bias)."""

import tempfile
import time
from pathlib import Path

import pytest
import torch

from miles_core.config import load_config
from miles_core.data import TASKS, PromptSource, load_examples
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.models import load_hf_dir
from miles_core.rollout.producer import RolloutProducer
from miles_core.run.runtime import RLRuntime, prepare_model_dir
from miles_core.types import Status
from miles_core.weights import TRANSPORTS
from miles_core.weights.source import TensorBuckets


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "name=async-test",
            "model.preset=tiny",
            "data.task=reverse",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=10",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "train.lr=3e-3",
            "train.threads=1",
            "rollout.engine=server",
            "rollout.engine_options.threads=1",
            "weight_sync.transport=shared_memory",
            f"checkpoint.root={tmp_path}/ckpt",
            *extra,
        ],
    )


def _run(cfg, steps):
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    metrics, consumed = [], []
    try:
        for step in range(steps):
            result = rt.rollout(step)
            consumed.append([s.metadata["data_index"] for g in result.groups for s in g.samples])
            rt.train(result)
            rt.update_weights()
            metrics.append(result.metrics)
    finally:
        rt.close()
    return metrics, consumed


@pytest.mark.slow
def test_fifty_async_steps_never_exceed_the_staleness_bound_and_consume_the_sync_order(tmp_path):
    cfg = _config(tmp_path, "rollout.mode=fully_async", "rollout.mode_options.max_staleness=2")
    metrics, consumed = _run(cfg, 50)
    worst = [m["rollout/staleness/max"] for m in metrics]
    assert max(worst) <= 2
    assert max(worst) >= 1  # the rollout really ran ahead of the trainer
    # paced admission consumes exactly the prompts a sync run would, in the same order: long
    # trajectories are never dropped, requeued or postponed
    d = cfg.data
    examples = load_examples(d.task, d.path, d.num_prompts, d.seed, d.storage_options)
    sync_source = PromptSource(examples, seed=d.seed, shuffle=d.shuffle)  # as a sync run's
    expected = [[i for i, _ in sync_source.next_batch(4) for _ in range(2)] for _ in range(50)]
    assert consumed == expected


@pytest.mark.slow
def test_one_step_off_trains_each_batch_one_version_old_in_the_sync_order(tmp_path):
    """`one_step_off`: the next batch is generated while the trainer trains and a push waits
    for it, so from step 1 on every batch is one version old and no sample spans a push."""
    cfg = _config(tmp_path, "rollout.mode=one_step_off")
    metrics, consumed = _run(cfg, 4)
    assert [m["rollout/staleness/max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/weight_version/mixed_version_ratio"] for m in metrics] == [0.0] * 4
    d = cfg.data
    examples = load_examples(d.task, d.path, d.num_prompts, d.seed, d.storage_options)
    sync_source = PromptSource(examples, seed=d.seed, shuffle=d.shuffle)
    assert consumed == [
        [i for i, _ in sync_source.next_batch(4) for _ in range(2)] for _ in range(4)
    ]


@pytest.fixture(scope="module")
def engine(tiny_dir, tmp_path_factory):
    proc = EngineProcess(tiny_dir, args=["--threads", "1"]).start()
    client = HttpEngine(proc.url)
    yield client
    client.close()
    proc.stop()


def _response_log_probs(model, sample) -> torch.Tensor:
    """The log-probs an HF forward of `model` gives the sample's response tokens."""
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(sample.tokens) - sample.response_length
    return lp[p - 1 : -1].gather(1, ids[0, p:, None])[:, 0]


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_push_during_generation_loses_no_request(engine, tiny_dir, tmp_path, mode):
    cfg = _config(tmp_path, "rollout.mode=fully_async", "rollout.max_new_tokens=48").rollout
    model, tok = load_hf_dir(tiny_dir)
    source = PromptSource(load_examples("reverse", None, 64, 0), seed=0)
    transport = TRANSPORTS.get("shared_memory")()
    transport.connect([engine])
    # the engine (shared by the module) starts from the model's own weights, whatever an
    # earlier test pushed: the old weights of the log-prob check below
    base = [(n, p.detach()) for n, p in model.named_parameters()]
    transport.push(TensorBuckets([base]), version=engine.weight_version + 1)
    version = [engine.weight_version]
    start = version[0]
    producer = RolloutProducer(
        engine, tok, TASKS.get("reverse"), source, cfg, version=lambda: version[0]
    ).start()
    try:
        _wait(lambda: engine.server_info()["running"] > 0)
        engine.pause("in_place")  # freeze them mid-generation, so the push meets them
        info = engine.server_info()
        assert info["running"] + info["waiting"] > 0
        g = torch.Generator().manual_seed(len(mode))
        new = [
            (n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
            for n, p in model.named_parameters()
        ]
        transport.push(TensorBuckets([new]), version=start + 1, pause_mode=mode)
        engine.resume()  # our own freeze (in_place pushes need no pause of their own)
        version[0] = start + 1
        producer.notify_version()
        result = producer.take(0)
    finally:
        producer.stop()
        transport.close()
    samples = result.samples
    assert len(samples) == cfg.prompts_per_step * cfg.n_samples_per_prompt
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    assert all(s.response_length == 48 or s.status == Status.COMPLETED for s in samples)
    spanning = [s for s in samples if s.weight_versions == [start, start + 1]]
    assert spanning, [s.weight_versions for s in samples]  # a trajectory across the push
    # tokens and log-probs stay aligned across the push: each reported log-prob is the one of
    # its own token, under the weights that generated it: a prefix under the old weights, the
    # rest under the pushed ones (recomputed here by an HF forward of each set of weights). A
    # request sent while the engine was frozen for the push is recorded as spanning too (the
    # producer's version moves after the resume) but runs on the new weights only: prefix 0.
    pushed = load_hf_dir(tiny_dir)[0]
    with torch.no_grad():
        for name, p in pushed.named_parameters():
            p.copy_(dict(new)[name])
    prefixes = []
    for s in spanning:
        n = s.response_length
        assert len(s.rollout_log_probs) == n
        got = torch.tensor(s.rollout_log_probs)
        on_old = (_response_log_probs(model, s) - got).abs() <= 1e-4
        on_new = (_response_log_probs(pushed, s) - got).abs() <= 1e-4
        k = int(on_old.int().cumprod(0).sum())  # the leading tokens of the old weights
        assert k < n, (mode, n)  # the tokens after the push are not the old weights'
        if mode != "in_place":  # re-prefilled (abort) or recomputed (retract) on the new weights
            assert bool(on_new[k:].all()), (mode, k, on_new.tolist())
        # (in_place keeps the old weights' KV of the earlier tokens: the tokens after the push
        # match neither forward exactly, only that they are not the old weights' is checked)
        prefixes.append(k)
    assert max(prefixes) > 0, prefixes  # a trajectory generated on both sides of the push
    if mode == "abort":
        assert producer.counters["continued_requests"] > 0


@pytest.mark.parametrize("policy", ["drop", "retry"])
def test_drop_and_retry_policies_never_hand_out_stale_groups(engine, tiny_dir, tmp_path, policy):
    cfg = _config(
        tmp_path,
        "rollout.mode=fully_async",
        "rollout.mode_options.max_staleness=0",
        f"rollout.mode_options.stale_policy={policy}",
    ).rollout
    _, tok = load_hf_dir(tiny_dir)
    source = PromptSource(load_examples("reverse", None, 64, 0), seed=0)
    version = [engine.weight_version]
    producer = RolloutProducer(
        engine, tok, TASKS.get("reverse"), source, cfg, version=lambda: version[0]
    ).start()
    try:
        _wait(lambda: producer.counters["admitted_groups"] >= cfg.prompts_per_step)
        producer.wait_idle()  # a full buffer of groups made at the current version
        first = [t.data_index for t in sorted(producer._tickets.values(), key=lambda t: t.index)]
        version[0] += 1  # a push: all of them are now one version stale
        engine.set_weight_version(version[0])
        producer.notify_version()
        result = producer.take(0)
    finally:
        producer.stop()
    assert producer.counters["stale_groups"] >= cfg.prompts_per_step
    assert result.metrics["rollout/staleness/max"] == 0
    taken = [g.samples[0].metadata["data_index"] for g in result.groups]
    if policy == "retry":  # the stale prompts come back first, regenerated on new weights
        assert sorted(taken) == sorted(first)
    else:
        assert not set(taken) & set(first)


def test_the_progress_watchdog_says_what_a_stalled_step_waits_on(
    engine, tiny_dir, tmp_path, caplog
):
    """A paused engine completes no group: `take` logs what it waits on every watchdog_s, and
    returns once the engine resumes."""
    import logging
    import threading

    cfg = _config(
        tmp_path, "rollout.mode=fully_async", "rollout.mode_options.watchdog_s=0.3"
    ).rollout
    _, tok = load_hf_dir(tiny_dir)
    source = PromptSource(load_examples("reverse", None, 64, 0), seed=0)
    version = engine.weight_version
    producer = RolloutProducer(engine, tok, TASKS.get("reverse"), source, cfg, lambda: version)
    out: list = []
    try:
        engine.pause("in_place")  # nothing can complete
        producer.start()
        with caplog.at_level(logging.WARNING, logger="miles.producer"):
            taker = threading.Thread(target=lambda: out.append(producer.take(0)), daemon=True)
            taker.start()
            _wait(lambda: sum("progress watchdog" in r.message for r in caplog.records) >= 2)
        engine.resume()
        taker.join(60)
    finally:
        engine.resume()
        producer.stop()
    warning = next(r.message for r in caplog.records if "progress watchdog" in r.message)
    assert f"step 0 waits for {cfg.prompts_per_step} groups" in warning
    assert "generating" in warning and f"engine serves version {version}" in warning
    assert out and len(out[0].groups) == cfg.prompts_per_step  # resumed: the step completes
