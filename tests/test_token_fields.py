"""One per-token channel: made-up fields declared once (tests/plugins/fields.py) reach the
trainer's micro-batch aligned with the tokens — after a sync rollout, a fully async rollout with
abort-continuations, a 3-turn session — and survive the async buffer's checkpoint exactly.

Alignment is checked by value: each row is a function of the token it belongs to, so a row
shifted by one position, dropped or duplicated anywhere on the way fails the comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from plugins import fields as plugin
from plugins.fields import PROBE, ROUTES, probe_of, routes_of

from miles_core.token_fields import FIELDS, TokenField, load_token_fields, token_field
from miles_core.train.batch import PaddedBatch, TrainBatch
from miles_core.types import Sample, SampleGroup, Status

PAD_ID = 0


@pytest.fixture(autouse=True)
def declared():
    plugin.declare()
    yield
    FIELDS.unregister(PROBE.name)
    FIELDS.unregister(ROUTES.name)


def assert_aligned(padded: PaddedBatch, batch: TrainBatch) -> None:
    """Every row of both fields is the function of its own token; padding is the pad value."""
    probe, routes = padded.fields["probe"], padded.fields["probe_routes"]
    assert probe.dtype == torch.float32 and routes.dtype == torch.int32
    assert probe.shape == padded.targets.shape
    assert routes.shape == (*padded.input_ids.shape, 2, 3)
    for i, (toks, n, mask) in enumerate(
        zip(batch.tokens, batch.response_lengths, batch.loss_masks, strict=True)
    ):
        response = np.array(toks[len(toks) - n :])
        assert padded.targets[i, :n].tolist() == response.tolist()
        want = np.where(np.array(mask) == 1, probe_of(response), PROBE.fill)
        assert np.array_equal(probe[i, :n].numpy(), want)
        assert (probe[i, n:] == PROBE.pad).all()
        seen = len(toks) - 1  # the last token is never fed
        assert np.array_equal(routes[i, :seen].numpy(), routes_of(toks[:-1]))
        assert (routes[i, seen:] == ROUTES.pad).all()


def micro_batches(samples: list[Sample], size: int) -> list[tuple[TrainBatch, PaddedBatch]]:
    """What the runtime and the backend do: the batch of the samples, sliced into micro-batches,
    each padded (`PaddedBatch.build`, the backend's forward input)."""
    batch = TrainBatch.from_samples(samples, [1.0] * len(samples), temperature=1.0)
    out = []
    for start in range(0, len(batch), size):
        mb = batch.slice(start, start + size)
        out.append((mb, PaddedBatch.build(mb, PAD_ID)))
    return out


# ---------------------------------------------------------------------- the declaration
def test_a_field_is_declared_once_and_its_wire_forms_round_trip_exactly():
    assert token_field("probe") is PROBE
    assert load_token_fields(["plugins.fields:ROUTES"])[0] is ROUTES  # by import path too
    values = np.array([0.1, -3.25, 1e-30], dtype=np.float32)
    assert PROBE.decode(PROBE.encode(values)).tobytes() == values.tobytes()
    routes = routes_of([5, 900, 31])
    wire = ROUTES.encode(routes)
    assert isinstance(wire, str)  # base64 of little-endian int32, SGLang's routed_experts form
    assert np.frombuffer(__import__("base64").b64decode(wire), "<i4").tolist() == (
        routes.reshape(-1).tolist()
    )
    assert np.array_equal(ROUTES.decode(wire), routes)
    for f, arr in ((PROBE, values), (ROUTES, routes)):
        back = f.from_json(json.loads(json.dumps(f.to_json(arr))))
        assert back.dtype == arr.dtype and back.tobytes() == arr.tobytes()


def test_declarations_that_would_clash_or_cannot_work_are_refused_by_name():
    with pytest.raises(ValueError, match="already declared differently"):
        FIELDS.register("probe", TokenField("probe", dtype="int32"))
    with pytest.raises(ValueError, match="'probe_values' is field 'probe'"):
        FIELDS.register("other", TokenField("other", wire_key="probe_values"))
    with pytest.raises(ValueError, match="not numeric"):
        TokenField("text", dtype="U8")
    with pytest.raises(ValueError, match="positive ints"):
        TokenField("bad", shape=(0, 2))
    with pytest.raises(ValueError, match="pkg.mod:NAME"):
        load_token_fields(["plugins.fields"])[0]
    with pytest.raises(ValueError, match="not a TokenField"):
        load_token_fields(["plugins.fields:probe_of"])[0]
    with pytest.raises(KeyError, match="no token field named 'nope'"):
        token_field("nope")
    with pytest.raises(ValueError, match="not whole rows"):
        ROUTES.decode(ROUTES.encode(routes_of([1, 2]))[:-8])


def test_a_run_declares_its_fields_in_the_config_and_a_bad_one_is_refused_up_front():
    from miles_core.config import load_config

    FIELDS.unregister("probe")
    cfg = load_config(None, ["model.preset=tiny", "rollout.token_fields=[plugins.fields:PROBE]"])
    assert cfg.rollout.token_fields == ["plugins.fields:PROBE"]
    assert token_field("probe") is PROBE  # declared by validating the config
    with pytest.raises(
        ValueError,
        match="(?s)rollout.token_fields.*cannot import token field 'plugins.nowhere:FIELD'",
    ):
        load_config(None, ["rollout.token_fields=[plugins.nowhere:FIELD]"])


def test_a_sample_with_a_misaligned_field_is_refused_naming_the_field():
    s = Sample(0, 3, "r", "p", [1, 2, 3, 4], 2, [1, 1], [0.0, 0.0])
    s.token_fields = {"probe": probe_of([3, 4]), "probe_routes": routes_of([1, 2, 3])}
    s.validate()
    s.token_fields["probe"] = probe_of([3, 4, 5])
    with pytest.raises(ValueError, match=r"sample 3: token field probe .*\(2,\)"):
        s.validate()
    s.token_fields = {"probe_routes": routes_of([1, 2])}  # sequence-aligned: tokens - 1 rows
    with pytest.raises(ValueError, match=r"probe_routes \(sequence-aligned\)"):
        s.validate()


def test_a_batch_refuses_a_training_sample_that_lacks_a_field_others_carry():
    with_field = Sample(0, 0, "a", "p", [1, 2, 3], 2, [1, 1], [0.0, 0.0])
    with_field.token_fields = {"probe": probe_of([2, 3])}
    without = Sample(0, 1, "b", "p", [1, 4, 5], 2, [1, 1], [0.0, 0.0])
    with pytest.raises(ValueError, match="sample b .* lacks token field probe"):
        TrainBatch.from_samples([with_field, without], None, 1.0)
    without.loss_mask = [0, 0]  # a failed episode's placeholder trains on nothing: pad rows
    batch = TrainBatch.from_samples([with_field, without], None, 1.0)
    padded = PaddedBatch.build(batch, PAD_ID)
    assert padded.fields["probe"][1].tolist() == [PROBE.pad, PROBE.pad]


def test_the_buffer_checkpoint_keeps_fields_bit_exact():
    from miles_core.data.tasks import Example
    from miles_core.rollout.buffer_state import group_from_json, group_to_json

    rng = np.random.default_rng(0)
    tokens = [7, 8, 9, 10, 11]
    s = Sample(0, 0, "r", "p", tokens, 3, [1, 1, 1], [-0.5, -1.0, -2.0], [0], 1.0)
    s.status = Status.COMPLETED
    s.token_fields = {
        "probe": rng.standard_normal(3).astype(np.float32),  # not representable in few digits
        "probe_routes": routes_of(tokens[:-1]),
    }
    stored = json.loads(json.dumps(group_to_json(SampleGroup(0, [s]))))
    (back,) = group_from_json(stored, Example(prompt="p", label=None)).samples
    assert set(back.token_fields) == {"probe", "probe_routes"}
    for name, arr in s.token_fields.items():
        got = back.token_fields[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes()


# ---------------------------------------------------------------------- (a) sync rollout
def test_sync_rollout_fields_reach_the_micro_batch_aligned(tiny, tiny_dir, monkeypatch):
    from miles_core.config import load_config
    from miles_core.data import TASKS, PromptSource, load_examples
    from miles_core.engines.cpu.embedded import EmbeddedEngine
    from miles_core.rollout.rollout_fn import generate_groups

    model, tok = tiny
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=reverse",
            "rollout.prompts_per_step=3",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=9",
            "train.global_batch_size=6",
            "train.micro_batch_size=3",
            "train.threads=1",
        ],
    )
    source = PromptSource(load_examples("reverse", None, 16, 0), seed=0)
    engine = plugin.FieldEngine(EmbeddedEngine(model, tok, seed=0))
    task = TASKS.get("reverse")
    samples = generate_groups(engine, tok, task, source.next_batch(3), cfg.rollout, 0).samples
    short = cfg.rollout.model_copy(update={"max_new_tokens": 4})  # ragged responses: padding
    samples += generate_groups(engine, tok, task, source.next_batch(3), short, 1).samples
    assert len({s.response_length for s in samples}) > 1
    assert len({s.prompt_length for s in samples}) > 1
    for s in samples:
        assert np.array_equal(s.token_fields["probe"], probe_of(s.response_tokens))
    for mb, padded in micro_batches(samples, size=5):  # 12 rows: micro-batches of 5, 5, 2
        assert_aligned(padded, mb)
    # and inside a real backend's train step: every micro-batch it pads carries them
    from miles_core.train.backend import BACKENDS

    seen: list[tuple[TrainBatch, PaddedBatch]] = []
    build = PaddedBatch.build.__func__

    def spy(cls, batch, pad_id, width=0):
        padded = build(cls, batch, pad_id, width)
        seen.append((batch, padded))
        return padded

    monkeypatch.setattr(PaddedBatch, "build", classmethod(spy))
    train = cfg.train.model_dump()
    backend = BACKENDS.get("fsdp")(model_dir=str(tiny_dir), optim=train, loss=train)
    try:
        mixed = samples[3:9]  # one global batch: long and short responses in each micro-batch
        batch = TrainBatch.from_samples(mixed, [1.0] * len(mixed), temperature=1.0)
        batch.old_log_probs = backend.compute_log_probs(batch)  # as the runtime does
        backend.train_step(batch)
    finally:
        backend.close()
    assert len(seen) >= 4 and all(len(b) == 3 for b, _ in seen)  # 2 forwards x 2 micro-batches
    for mb, padded in seen:
        assert_aligned(padded, mb)


# ---------------------------------------------------------------------- (b) async + abort
@pytest.fixture(scope="module")
def engine_server(tiny_dir):
    from miles_core.engines.http import EngineProcess

    proc = EngineProcess(tiny_dir, args=["--threads", "1"]).start()
    yield proc
    proc.stop()


def _seeds_by_rid(bodies: list[dict]) -> dict[str, tuple[int, int]]:
    """rid -> (sampling seed, input length) of every /generate request the proxy saw."""
    out = {}
    for body in bodies:
        batch = isinstance(body["input_ids"][0], list)
        rids = body["rid"] if batch else [body["rid"]]
        sps = body["sampling_params"] if batch else [body["sampling_params"]]
        ids = body["input_ids"] if batch else [body["input_ids"]]
        for rid, sp, x in zip(rids, sps, ids, strict=True):
            out[rid] = (sp["sampling_seed"], len(x))
    return out


def test_async_abort_continuations_join_fields_aligned_with_fresh_seeds(
    engine_server, tiny_dir, tmp_path
):
    import time

    from miles_core.config import load_config
    from miles_core.data import TASKS, PromptSource, load_examples
    from miles_core.engines.http import HttpEngine
    from miles_core.models import load_hf_dir
    from miles_core.rollout.producer import RolloutProducer
    from miles_core.rollout.rollout_fn import continuation_seed
    from miles_core.weights import TRANSPORTS
    from miles_core.weights.source import TensorBuckets

    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=reverse",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=48",
            "rollout.engine=server",
            "rollout.mode=fully_async",
            "rollout.pause_mode=abort",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "weight_sync.transport=shared_memory",
            f"checkpoint.root={tmp_path}/ckpt",
        ],
    ).rollout
    model, tok = load_hf_dir(tiny_dir)
    proxy = plugin.FieldProxy(engine_server.url).start()
    direct = HttpEngine(engine_server.url)  # the trainer's side: pushes go straight to it
    via_proxy = HttpEngine(proxy.url)  # the producer's side: /generate answers carry fields
    version = [direct.weight_version]
    start = version[0]
    source = PromptSource(load_examples("reverse", None, 64, 0), seed=0)
    producer = RolloutProducer(
        via_proxy, tok, TASKS.get("reverse"), source, cfg, version=lambda: version[0]
    ).start()
    transport = TRANSPORTS.get("shared_memory")()
    transport.connect([direct])
    try:
        deadline = time.monotonic() + 60
        while direct.server_info()["running"] == 0:  # wait until requests are mid-generation
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.005)
        direct.pause("in_place")  # freeze them, so the abort push meets them mid-generation
        g = torch.Generator().manual_seed(1)
        new = [
            (n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
            for n, p in model.named_parameters()
        ]
        transport.push(TensorBuckets([new]), version=start + 1, pause_mode="abort")
        direct.resume()
        version[0] = start + 1
        producer.notify_version()
        result = producer.take(0)
    finally:
        producer.stop()
        transport.close()
        via_proxy.close()
        direct.close()
        proxy.stop()
    assert producer.counters["continued_requests"] > 0
    samples = result.samples
    spanning = [s for s in samples if s.weight_versions == [start, start + 1]]
    assert spanning, [s.weight_versions for s in samples]  # continued across the push
    for mb, padded in micro_batches(samples, size=8):
        assert_aligned(padded, mb)
    # each continuation drew from its own seed, derived from (seed, tokens so far): not a replay
    seen = _seeds_by_rid(proxy.requests)
    continued = {rid: v for rid, v in seen.items() if "-c" in rid}
    assert continued
    for rid, (seed, length) in continued.items():
        first_seed, prompt_len = seen[rid.split("-c")[0]]
        assert seed == continuation_seed(first_seed, length - prompt_len)
        assert seed != first_seed


def test_a_continuation_does_not_redraw_the_uniforms_of_its_first_tokens():
    """The serving engine draws one uniform per token from a generator seeded with the
    request's sampling_seed: the continuation's stream must be neither the original's (its
    first tokens' draws again) nor a sibling's (request seeds of a step are consecutive)."""
    from miles_core.engines.wire import GenerateRequest, SamplingParams
    from miles_core.rollout.engine_groups import continuation_request
    from miles_core.rollout.rollout_fn import request_seed

    def draws(seed: int, n: int) -> list[float]:
        g = torch.Generator().manual_seed(seed)  # as serving.py seeds a request's stream
        return [torch.rand(1, generator=g, dtype=torch.float64).item() for _ in range(n)]

    seeds = [request_seed(0, 3, i) for i in range(16)]  # one step's requests
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=20, sampling_seed=seeds[0]),
        rid="3-0-0",
    )
    original = draws(seeds[0], 20)
    for k in (1, 5, 12):
        cont = continuation_request(req, list(range(10, 10 + k)), f"3-0-0-c{k}")
        sp = cont.sampling_params
        assert cont.input_ids == [1, 2, 3, *range(10, 10 + k)] and sp.max_new_tokens == 20 - k
        assert sp.sampling_seed not in seeds  # not a sibling's stream
        first = draws(sp.sampling_seed, 20 - k)
        assert first[:k] != original[:k]  # not the original's first draws again
        assert not set(first) & set(original)
        again = continuation_request(req, list(range(10, 10 + k)), f"3-0-0-c{k}")
        assert again.sampling_params.sampling_seed == sp.sampling_seed  # reproducible


# ---------------------------------------------------------------------- (c) sessions
def _turn(traj, messages, reply, engine_out: list[int]):
    """One session turn as the session server records it, the engine's answer annotated."""
    from miles_core.engines.wire import GenerateResponse

    turn = traj.attach(messages, None)
    meta = {
        "finish_reason": {"type": "stop", "matched": 0},
        "prompt_tokens": len(turn.ids),
        "completion_tokens": len(engine_out),
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in engine_out],
    }
    out = GenerateResponse(
        output_ids=engine_out, meta_info=plugin.annotate(meta, turn.ids, engine_out)
    )
    lps = out.output_log_probs
    traj.record(turn, messages, None, reply, out.output_ids, lps, 0, "stop", out.token_fields)
    return turn


def test_three_session_turns_merge_fields_per_turn_with_fill_on_appended_tokens():
    from miles_core.sessions.trajectory import Trajectory
    from miles_core.tito import FAMILIES

    family = FAMILIES.get("tiny")()
    traj = Trajectory(family, "sess")
    messages = [{"role": "user", "content": "one"}]
    generated = []
    for k, word in enumerate(["alpha", "beta", "gamma"]):
        reply = {"role": "assistant", "content": word}
        ids = list(family.completion(reply, None))
        turn = _turn(traj, messages, reply, ids)
        assert (turn.parent is None) == (k == 0)  # each turn extends the last one
        generated.append(ids)
        messages = messages + [reply, {"role": "user", "content": f"turn {k + 2}"}]
    (sample,) = traj.samples(reward=1.0)
    sample.validate()
    assert sample.metadata["turns"] == 3
    assert sum(sample.loss_mask) == sum(len(ids) for ids in generated)
    assert 0 in sample.loss_mask  # the appended user turns, with the fill value
    for mb, padded in micro_batches([sample], size=1):
        assert_aligned(padded, mb)


def test_a_real_session_carries_fields_to_the_micro_batch(engine_server):
    """Three chat turns through the session server (in process) in front of the engine server
    (behind the annotating proxy); the samples come back as JSON and are batched."""
    from fastapi.testclient import TestClient

    from miles_core.sessions.server import create_app
    from miles_core.tito import FAMILIES
    from miles_core.types import sample_from_json

    proxy = plugin.FieldProxy(engine_server.url).start()
    try:
        with TestClient(create_app(proxy.url, FAMILIES.get("tiny")())) as c:
            sid = c.post("/sessions", json={"rollout_id": "sess-1"}).json()["session_id"]
            url = f"/sessions/{sid}/v1/chat/completions"
            messages = [{"role": "user", "content": "count"}]
            for k in range(3):
                r = c.post(url, json={"messages": messages, "max_tokens": 6, "seed": k})
                assert r.status_code == 200, r.text
                reply = r.json()["choices"][0]["message"]
                messages = messages + [
                    {"role": "assistant", "content": reply["content"] or ""},
                    {"role": "user", "content": f"again {k}"},
                ]
            data = c.post(f"/sessions/{sid}/samples", json={"reward": 1.0}).json()
    finally:
        proxy.stop()
    samples = [sample_from_json(s) for s in json.loads(json.dumps(data["samples"]))]
    assert len(samples) == 1 and samples[0].metadata["turns"] == 3
    samples[0].validate()
    for mb, padded in micro_batches(samples, size=1):
        assert_aligned(padded, mb)


def test_a_sequence_aligned_field_keeps_the_padded_rows():
    """The shared-prompt forward runs a prompt once for all its rows, so a field with one row per
    fed position (routing replay) would lose its per-row prompt rows: such batches stay padded."""
    from miles_core.train.shared_prefix import SharedPrefix

    tokens = [[7, 8, 1, 2], [7, 8, 3, 4]]
    twins = TrainBatch(tokens=tokens, response_lengths=[2, 2], loss_masks=[[1, 1]] * 2)
    assert SharedPrefix.build(twins, PAD_ID) is not None
    twins.token_fields = {"probe": [probe_of(np.array(t[2:])) for t in tokens]}
    assert SharedPrefix.build(twins, PAD_ID) is not None  # response-aligned: unaffected
    twins.token_fields["probe_routes"] = [routes_of(t[:-1]) for t in tokens]
    assert SharedPrefix.build(twins, PAD_ID) is None
