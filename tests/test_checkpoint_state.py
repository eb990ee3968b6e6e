"""What a checkpoint holds beyond the weights, round-tripped: RNG states, the async producer's
buffer (against a real engine server), the ledger of trained sample ids, and the resume rules
(`--resume-step`, buffers a config cannot continue, batch-shape changes)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from miles_core.checkpoint import rng_state
from miles_core.checkpoint.ledger import LEDGER_FILE, TrainedLedger, read_lineage
from miles_core.checkpoint.resume_checks import shape_changes
from miles_core.checkpoint.store import CheckpointStore
from miles_core.config import load_config
from miles_core.data import TASKS, PromptSource, load_examples
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.models import build_model, load_hf_dir
from miles_core.rollout.buffer_state import BUFFER_FILE, group_from_json, group_to_json
from miles_core.rollout.producer import RolloutProducer
from miles_core.run.preflight import preflight
from miles_core.types import Sample, SampleGroup, Status


def test_rng_states_survive_json():
    random.random(), torch.rand(3)
    saved = json.loads(json.dumps(rng_state.capture()))
    expected = (random.random(), torch.rand(4).tolist())
    random.random(), torch.rand(9)  # the streams move on
    rng_state.restore(saved)
    assert (random.random(), torch.rand(4).tolist()) == expected
    g = torch.Generator().manual_seed(3)
    g_state = rng_state.encode_generator(g)
    want = torch.rand(5, generator=g)
    rng_state.decode_generator(g, g_state)
    assert torch.equal(torch.rand(5, generator=g), want)


def _sample(k: int, prompt, label) -> Sample:
    return Sample(
        group_index=2,
        index=2 * 2 + k,
        rollout_id=f"s1-g2-{k}",
        prompt=prompt,
        tokens=[1, 2, 3, 40 + k, 41],
        response_length=2,
        loss_mask=[1, 0],
        rollout_log_probs=[-0.1234567890123, -2.5e-9],
        weight_versions=[3, 4],
        reward=0.75,
        status=Status.TRUNCATED,
        label=label,
        response="xy",
        metadata={"data_index": 7, "metrics": {"exact_match": 0.0}, "cached_tokens": 3},
    )


def test_a_buffered_group_round_trips_exactly_with_its_row():
    from miles_core.data.tasks import Example

    row = Example(prompt=[{"role": "user", "content": "hi"}], label=("not", "json"), answer=None)
    group = SampleGroup(2, [_sample(k, row.prompt, row.label) for k in range(2)])
    stored = json.loads(json.dumps(group_to_json(group)))
    assert "label" not in stored["samples"][0]  # taken from the dataset row on restore
    assert group_from_json(stored, row) == group


@pytest.fixture(scope="module")
def engine(tiny_dir):
    proc = EngineProcess(tiny_dir, args=["--threads", "1"]).start()
    client = HttpEngine(proc.url, batch_size=2)
    yield client
    client.close()
    proc.stop()


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _states(producer, state):
    return [g for g in producer.snapshot()["groups"] if g["state"] == state]


def test_the_producer_buffer_survives_a_restart(engine, tiny_dir, tmp_path):
    """Completed groups come back as they were, groups in flight are generated again under
    their own ids, and the next prompt is the one after the last admitted group."""
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=reverse",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "rollout.engine=server",
            "weight_sync.transport=shared_memory",
            "rollout.mode=fully_async",
        ],
    ).rollout
    _, tok = load_hf_dir(tiny_dir)
    examples = load_examples("reverse", None, 64, 0)
    task = TASKS.get("reverse")
    version = [0]
    a = RolloutProducer(engine, tok, task, PromptSource(examples, seed=0), cfg, lambda: version[0])
    try:
        a.start()
        a.take(0)  # at version 0, the groups of step 1 may run ahead
        _wait(lambda: len(_states(a, "done")) == 4)
        engine.pause("in_place")  # what is admitted now stays in flight
        version[0] = 1
        a.notify_version()  # step 2's groups start
        _wait(lambda: len(_states(a, "generating")) == 4)
        snap = json.loads(json.dumps(a.snapshot()))  # as stored in rollout_buffer.json
    finally:
        a.stop()
        engine.resume()
    assert [g["index"] for g in snap["groups"]] == list(range(4, 12))
    assert snap["next_index"] == 12

    b = RolloutProducer(engine, tok, task, PromptSource(examples, seed=0), cfg, lambda: version[0])
    b.restore(snap)
    try:
        b.start()
        step1 = b.take(1)
        step2 = b.take(2)
        version[0] = 2
        b.notify_version()
        step3 = b.take(3)
    finally:
        b.stop()
    done = [g["group"] for g in snap["groups"] if g["state"] == "done"]
    for got, saved in zip(step1.groups, done, strict=True):
        assert group_to_json(got)["samples"] == saved["samples"]  # trained as generated
    assert [s.rollout_id for s in step2.samples] == [
        f"s2-g{g}-{k}" for g in range(4) for k in range(2)
    ]
    order = [i for i, _ in PromptSource(examples, seed=0).next_batch(16)]
    for step, result in ((1, step1), (2, step2), (3, step3)):
        got = [s.metadata["data_index"] for s in result.samples]
        assert got == [i for i in order[4 * step : 4 * step + 4] for _ in range(2)], step
    assert b.counters["admitted_groups"] >= 16  # counters continue (metrics stay monotone)


def _empty_checkpoint(store: CheckpointStore, step: int, ledger: TrainedLedger, **files):
    model, tok = build_model("tiny", 0)
    state = {"step": step, "policy_version": step + 1}
    store.save(
        step,
        lambda d: (model.save_pretrained(d), tok.save_pretrained(d)),
        state,
        {LEDGER_FILE: ledger.to_json(), **files},
    )
    ledger.saved(step)


def _groups(step: int, lineage: str) -> list[SampleGroup]:
    samples = [_sample(k, "p", None) for k in range(2)]
    for s in samples:
        s.rollout_id = f"s{step}-{lineage}-{s.index}"
    return [SampleGroup(0, samples)]


def test_the_ledger_follows_the_lineage_past_an_abandoned_continuation(tmp_path):
    store = CheckpointStore(str(tmp_path), "run")
    first = TrainedLedger()
    for step in range(6):  # checkpoints after steps 1, 3, 5
        first.record(step, _groups(step, "first"))
        if step % 2:
            _empty_checkpoint(store, step, first)
    assert store.steps() == [1, 3, 5] and store.latest_step() == 5
    second = TrainedLedger(previous_step=1)  # --resume-step 1, then checkpoint 4 only
    for step in (2, 3, 4):
        second.record(step, _groups(step, "second"))
    _empty_checkpoint(store, 4, second)
    lineage = read_lineage(store, 4)  # 4 → 1 → start, not through the abandoned 3
    assert {s: r["sample_ids"][0].split("-")[1] for s, r in lineage.items()} == {
        0: "first",
        1: "first",
        2: "second",
        3: "second",
        4: "second",
    }
    assert lineage[2]["weight_versions"] == [[3, 4], [3, 4]]
    assert sorted(read_lineage(store, 5)) == list(range(6))  # the abandoned one stays readable
    store.mark_latest(3)
    assert store.latest_step() == 3
    assert not list(tmp_path.glob("run/.latest.tmp"))
    store.close()


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "name=r",
            "model.preset=tiny",
            "train.num_steps=10",
            f"checkpoint.root={tmp_path}",
            *extra,
        ],
    )


def test_resume_rules_refuse_before_anything_starts(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    snap = {
        "version": 1,
        "prompts_per_step": 16,
        "n_samples_per_prompt": 8,
        "groups": [{"index": 32, "state": "generating"}],
    }
    _empty_checkpoint(store, 1, TrainedLedger())
    _empty_checkpoint(store, 3, TrainedLedger(), **{BUFFER_FILE: snap})
    ok = _config(tmp_path)
    preflight(ok, resume=True, resume_step=1)  # an earlier checkpoint: accepted
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 2 .*saved steps: 1, 3"):
        preflight(ok, resume_step=2)
    with pytest.raises(ValueError, match="rollout.mode sync cannot continue"):
        preflight(ok, resume=True)  # the latest holds an async buffer
    server = [
        "rollout.engine=server",
        "weight_sync.transport=shared_memory",
        "rollout.mode=fully_async",
    ]
    preflight(_config(tmp_path, *server), resume=True)
    with pytest.raises(ValueError, match="rollout.prompts_per_step 16, the config has 8"):
        bad = _config(tmp_path, *server, "rollout.prompts_per_step=8", "train.global_batch_size=64")
        preflight(bad, resume=True)
    store.close()


def test_a_changed_batch_shape_is_named(tmp_path):
    saved = _config(tmp_path).model_dump(mode="json")
    assert shape_changes(saved, _config(tmp_path)) == []
    assert shape_changes(None, _config(tmp_path)) == []  # an older checkpoint: nothing to say
    changed = _config(tmp_path, "train.micro_batch_size=16", "train.num_steps=20")
    assert shape_changes(saved, changed) == ["train.micro_batch_size 32 → 16"]  # constant LR
    cosine = _config(tmp_path, "train.lr_decay_style=cosine")
    saved_cosine = cosine.model_dump(mode="json")
    longer = _config(tmp_path, "train.lr_decay_style=cosine", "train.num_steps=20")
    assert shape_changes(saved_cosine, longer) == ["train.num_steps 10 → 20"]


def test_cli_refuses_a_missing_resume_step_with_exit_2(tmp_path, capsys, monkeypatch):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    # refused before any flow: an API URL of its own, so no local Prefect server is started
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    _empty_checkpoint(CheckpointStore(str(tmp_path), "r"), 1, TrainedLedger())
    args = ["train", "--set", "name=r", "--set", "model.preset=tiny"]
    rc = main([*args, "--set", f"checkpoint.root={tmp_path}", "--resume-step", "4"])
    assert rc == 2
    assert "--resume-step 4: run 'r' has no checkpoint of step 4" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_buffer_filled_under_another_stale_policy_is_refused():
    from miles_core.rollout.buffer_state import BUFFER_VERSION, check_buffer

    data = {"version": BUFFER_VERSION, "prompts_per_step": 4, "n_samples_per_prompt": 2}
    check_buffer(data | {"stale_policy": "pace"}, 4, 2, "pace")
    check_buffer(data, 4, 2, "pace")  # buffers written before the field: not checked
    with pytest.raises(ValueError, match="resume with rollout.mode_options.stale_policy=drop"):
        check_buffer(data | {"stale_policy": "drop"}, 4, 2, "pace")
