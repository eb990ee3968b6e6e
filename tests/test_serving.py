"""The serving engine: continuous batching, prefix reuse, abort, pause modes, memory release."""

import contextlib
import copy
import random
import threading
import time

import pytest
import torch
from test_engine import BAD_REQUESTS

from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.cpu.slots import SlotState, SlotTable, common_prefix
from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams
from miles_core.models.qwen3 import runner as runner_mod
from miles_core.rollout.rollout_fn import encode_prompt, engine_load


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    eng = ServingEngine(copy.deepcopy(model), tok, seed=3, max_running=8, cache_slots=16)
    yield eng
    eng.close()


def _req(tok, text="say a", rid=None, **sp):
    return GenerateRequest(
        input_ids=encode_prompt(tok, text), sampling_params=SamplingParams(**sp), rid=rid
    )


def _recompute(model, req, resp):
    full = torch.tensor([req.input_ids + resp.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0].float(), -1)
    p = len(req.input_ids)
    return lp[p - 1 : p - 1 + len(resp.output_ids)].gather(
        1, torch.tensor(resp.output_ids)[:, None]
    )[:, 0]


def test_logprobs_match_the_hf_forward_with_and_without_prefix_hits(engine, tiny):
    model, tok = tiny
    reqs = [_req(tok, "reverse abcdefg", max_new_tokens=10) for _ in range(4)]
    reqs += [_req(tok, t, max_new_tokens=10) for t in ["12+34=", "go"]]
    out = engine.generate(reqs, timeout=60)
    for req, resp in zip(reqs, out, strict=True):
        assert torch.allclose(
            _recompute(model, req, resp), torch.tensor(resp.output_log_probs), atol=1e-5
        )
    # siblings of one prompt reuse its KV: every prompt token but the last is cached
    assert (
        sorted(r.meta_info.cached_tokens for r in out[:4]) == [0] + [len(reqs[0].input_ids) - 1] * 3
    )
    assert engine.prefix_cache_hit_rate() > 0


def test_requests_join_and_leave_between_decode_steps(engine, tiny):
    model, tok = tiny
    long = engine.submit(_req(tok, "reverse abcdefgh", rid="long", max_new_tokens=200))
    shorts = [engine.submit(_req(tok, f"{i}+1=", rid=f"s{i}", max_new_tokens=3)) for i in range(6)]
    for h in shorts:  # short requests finish while the long one keeps running
        assert len(h.result(timeout=30).output_ids) == 3
    assert not long.done()
    resp = long.result(timeout=60)
    assert len(resp.output_ids) == 200 and resp.meta_info.finish_reason.type == "length"
    req = _req(tok, "reverse abcdefgh", max_new_tokens=200)
    assert torch.allclose(
        _recompute(model, req, resp), torch.tensor(resp.output_log_probs), atol=1e-5
    )


def test_multi_turn_prefix_is_reused(engine, tiny):
    _, tok = tiny
    history = encode_prompt(tok, "turn 0")
    for turn in range(1, 6):
        resp = engine.generate(
            [GenerateRequest(input_ids=history, sampling_params=SamplingParams(max_new_tokens=5))]
        )[0]
        if turn > 1:
            assert (
                resp.meta_info.cached_tokens
                >= len(history) - len(encode_prompt(tok, f"turn {turn}")) - 1
            )
        history = history + resp.output_ids + tok.encode(f"\nturn {turn}", add_special_tokens=False)


def test_abort_one_and_abort_all(engine, tiny):
    _, tok = tiny
    a = engine.submit(_req(tok, rid="a", max_new_tokens=400))
    b = engine.submit(_req(tok, rid="b", max_new_tokens=400))
    with frozen_after(engine, a, 2):  # both are mid-generation here
        assert engine.abort("a") == 1
        ra = a.result(timeout=30)
        assert ra.meta_info.finish_reason.type == "abort" and 2 <= len(ra.output_ids) < 400
        assert engine.abort() == 1
    assert b.result(timeout=30).meta_info.finish_reason.type == "abort"
    assert engine.abort("missing") == 0


@contextlib.contextmanager
def frozen_after(engine, handle, n):
    """Holds the engine between two steps once `handle` has n tokens: no token is produced while
    the block runs, so a pause or abort inside it always meets the request mid-generation."""
    deadline = time.monotonic() + 30
    while True:
        hold = engine.between_steps()
        hold.__enter__()
        if len(handle._r.output) >= n:
            break
        hold.__exit__(None, None, None)
        assert time.monotonic() < deadline, "the request made no progress"
        time.sleep(0.001)
    try:
        yield
    finally:
        hold.__exit__(None, None, None)


def test_pause_abort_returns_partial_output(engine, tiny):
    _, tok = tiny
    h = engine.submit(_req(tok, rid="x", max_new_tokens=400))
    with frozen_after(engine, h, 3):
        engine.pause("abort")
    r = h.result(timeout=30)
    assert r.meta_info.finish_reason.type == "abort" and 3 <= len(r.output_ids) < 400
    queued = engine.submit(_req(tok, rid="y", max_new_tokens=2))
    assert not queued.done()  # paused: new requests wait
    engine.resume()
    assert len(queued.result(timeout=30).output_ids) == 2


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_lose_nothing_and_continue_the_same_tokens(tiny, mode):
    model, tok = tiny
    reqs = [
        _req(tok, f"reverse abc{i}", rid=f"r{i}", max_new_tokens=300, sampling_seed=100 + i)
        for i in range(3)
    ]
    ref_engine = ServingEngine(copy.deepcopy(model), tok, max_running=8)
    reference = ref_engine.generate(reqs, timeout=60)
    ref_engine.close()

    engine = ServingEngine(copy.deepcopy(model), tok, max_running=8)
    handles = [engine.submit(r) for r in reqs]
    with frozen_after(engine, handles[0], 5):
        engine.pause(mode)
    progress = [len(h._r.output) for h in handles]
    assert all(not h.done() for h in handles)
    state = engine.load_state()
    if mode == "retract":
        assert state["running"] == 0 and state["waiting"] == 3
    else:
        assert state["running"] == 3
    threading.Event().wait(0.05)  # paused: nothing advances (checked below)
    assert [len(h._r.output) for h in handles] == progress
    engine.resume()
    out = [h.result(timeout=60) for h in handles]
    engine.close()
    for got, want, req in zip(out, reference, reqs, strict=True):
        assert (
            got.output_ids == want.output_ids
        )  # per-request seeds: same tokens as without a pause
        assert torch.allclose(
            _recompute(model, req, got), torch.tensor(got.output_log_probs), atol=1e-5
        )


def test_weight_update_sets_version_and_never_reuses_stale_kv(engine, tiny):
    _, tok = tiny
    engine.generate([_req(tok, "reverse abcdefg", max_new_tokens=3)])  # a cached prefix
    running = engine.submit(_req(tok, "reverse abcdefg", rid="frozen", max_new_tokens=300))
    with frozen_after(engine, running, 2):
        engine.pause("in_place")  # frozen with KV from the old weights
    name, t = next(iter(engine.named_tensors().items()))
    t = t.clone()
    engine.update_weights_from_tensor([(name, t + 1.0)])
    engine.set_weight_version(7)
    engine.resume()
    assert running.result(timeout=60).meta_info.weight_version == "7"
    r = engine.generate([_req(tok, "reverse abcdefg", max_new_tokens=3)])[0]
    assert r.meta_info.cached_tokens == 0  # neither the flushed cache nor the frozen slot's KV
    assert r.meta_info.weight_version == "7"
    with pytest.raises(KeyError, match="no parameter"):  # a bad push changes nothing
        engine.update_weights_from_tensor([(name, t), ("nope", t)])
    assert torch.equal(engine.named_tensors()[name], t + 1.0)


def test_release_and_resume_memory(engine, tiny):
    _, tok = tiny
    before = {n: t.clone() for n, t in engine.named_tensors().items()}
    engine.release_memory(["weights", "kv_cache"])
    assert all(t.numel() == 0 for t in engine.named_tensors().values())
    with pytest.raises(EngineRequestError, match="released"):
        engine.submit(_req(tok))
    engine.resume_memory(["weights", "kv_cache"])
    engine.update_weights_from_tensor(before.items())
    assert all(torch.equal(engine.named_tensors()[n], t) for n, t in before.items())
    assert len(engine.generate([_req(tok, max_new_tokens=4)])[0].output_ids) == 4


@pytest.mark.parametrize("ids, sp, message", BAD_REQUESTS)
def test_bad_requests_are_refused(engine, ids, sp, message):
    with pytest.raises(EngineRequestError, match=message):
        engine.submit(GenerateRequest(input_ids=ids, sampling_params=SamplingParams(**sp)))


def test_running_requests_are_compacted_and_their_kv_moves_with_them(engine, tiny):
    """Requests of many lengths finish at different steps; each hole is filled by moving a
    running request's KV row, and every log-prob still matches the HF forward."""
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    reqs = [
        _req(tok, f"reverse {'abcdefgh'[: 1 + i % 8]}", max_new_tokens=int(n))
        for i, n in enumerate(torch.randint(1, 30, (14,), generator=g))
    ]
    out = engine.generate(reqs, timeout=60)
    assert engine.stats["slot_moves"] > 0
    for req, resp in zip(reqs, out, strict=True):
        assert len(resp.output_ids) == req.sampling_params.max_new_tokens
        assert torch.allclose(
            _recompute(model, req, resp), torch.tensor(resp.output_log_probs), atol=1e-5
        )


def test_caller_scheduler_gives_the_thread_schedulers_tokens(engine, tiny):
    model, tok = tiny
    reqs = [
        _req(tok, f"{i}+{i}=", max_new_tokens=12, sampling_seed=100 + i, stop_token_ids=None)
        for i in range(10)
    ]
    caller = ServingEngine(
        copy.deepcopy(model), tok, seed=3, max_running=8, cache_slots=16, scheduler="caller"
    )
    try:
        got = caller.generate(reqs)
        with pytest.raises(EngineRequestError, match="inside generate"):
            caller.submit(reqs[0])
    finally:
        caller.close()
    want = engine.generate(reqs, timeout=60)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


@pytest.mark.parametrize("gemms", ["this_cpu", "emulated"])
def test_bfloat16_engine_stays_within_its_low_precision_contract(tiny, monkeypatch, gemms):
    """bf16 GEMMs (this CPU's own where it has them, and the emulation every CPU can run): log-probs
    within 0.05 of the fp32 forward, every token from the vocabulary."""
    if gemms == "emulated":
        monkeypatch.setattr(runner_mod, "bf16_gemms_native", lambda device: False)
    model, tok = tiny
    eng = ServingEngine(copy.deepcopy(model), tok, seed=0, max_running=8, dtype="bfloat16")
    try:
        assert eng.runner.emulate_bf16 == (not runner_mod.bf16_gemms_native(eng.device))
        reqs = [_req(tok, f"reverse abc{i}", max_new_tokens=16) for i in range(8)]
        out = eng.generate(reqs, timeout=60)
    finally:
        eng.close()
    assert all(r.meta_info.finish_reason.type == "length" for r in out)
    gaps = [
        (_recompute(model, q, r) - torch.tensor(r.output_log_probs)).abs().max().item()
        for q, r in zip(reqs, out, strict=True)
    ]
    assert max(gaps) < 0.05
    assert all(0 <= t < model.config.vocab_size for r in out for t in r.output_ids)


def test_emulated_bf16_gemm_is_torchs_bf16_gemm(tiny, monkeypatch):
    """Where a CPU has no bf16 GEMMs the runner widens bf16 operands to fp32 and rounds the result
    once: the numbers of PyTorch's own bf16 GEMM (fp32 accumulation), up to one bf16 rounding step
    where the two accumulation orders straddle a rounding boundary."""
    monkeypatch.setattr(runner_mod, "bf16_gemms_native", lambda device: False)
    model, _ = tiny
    runner = runner_mod.Qwen3Runner(model, slots=1, max_len=8, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).bfloat16()
    w = torch.randn(192, 64, generator=g)
    got = runner._mm(x, runner._pack(w))
    want = torch.nn.functional.linear(x, w.bfloat16())
    assert got.dtype == torch.bfloat16
    same = (got.view(torch.int16) == want.view(torch.int16)).float().mean().item()
    assert same > 0.98
    ulp = want.float().abs() * 2.0**-7
    assert ((got.float() - want.float()).abs() <= ulp).all()


def test_load_counters_give_active_requests_and_queue_depth(tiny):
    model, tok = tiny
    eng = ServingEngine(copy.deepcopy(model), tok, max_running=2, scheduler="caller")
    try:
        before = eng.load_counters()
        eng.generate([_req(tok, f"{i}+1=", max_new_tokens=6) for i in range(6)])
        load = engine_load(before, eng.load_counters())
    finally:
        eng.close()
    assert load["rollout/engine_steps"] >= 18  # 6 requests × 6 tokens, 2 at a time
    assert 1.0 < load["rollout/engine_active_requests"] <= 2.0
    assert load["rollout/engine_queue_depth"] > 0.5


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_caller_engine_honours_pause_from_another_thread_and_close(engine, tiny):
    model, tok = tiny
    req = _req(tok, "reverse abc", max_new_tokens=150, sampling_seed=7)
    want = engine.generate([req], timeout=60)[0].output_ids
    caller = ServingEngine(copy.deepcopy(model), tok, max_running=8, scheduler="caller")
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(caller.generate([req])))
    worker.start()
    _wait_for(lambda: caller.stats["generated_tokens"] >= 5)
    caller.pause("in_place")  # the stepping thread waits; the request keeps its KV
    frozen = caller.stats["generated_tokens"]
    assert frozen < 150
    caller.resume()
    worker.join(timeout=60)
    assert got[0].output_ids == want  # nothing lost, same tokens as an uninterrupted run

    got.clear()
    long = _req(tok, "reverse abc", max_new_tokens=400)
    worker = threading.Thread(target=lambda: got.extend(caller.generate([long])))
    worker.start()
    _wait_for(lambda: caller.stats["generated_tokens"] >= frozen + 155)
    caller.close()
    worker.join(timeout=60)
    assert got[0].meta_info.finish_reason.type == "abort" and len(got[0].output_ids) < 400
    assert not caller.alive()
    with pytest.raises(EngineRequestError, match="stopped"):
        caller.generate([req])


def test_seeded_streams_drawn_ahead_sample_as_drawn_one_at_a_time(tiny, monkeypatch):
    """A seeded request's sampling numbers are drawn UNIFORMS_AHEAD at a time: the same tokens
    and log-probs as one draw per token, across a chunk boundary, beside requests that end early."""
    import miles_core.engines.cpu.serving as serving

    model, tok = tiny
    reqs = [
        _req(tok, f"{i}+{i}=", max_new_tokens=90 - 30 * (i % 3), sampling_seed=50 + i)
        for i in range(6)
    ]
    reqs = [r.model_copy(update={"rid": f"s{i}"}) for i, r in enumerate(reqs)]
    outs = []
    for ahead in (serving.UNIFORMS_AHEAD, 1):
        monkeypatch.setattr(serving, "UNIFORMS_AHEAD", ahead)
        eng = ServingEngine(copy.deepcopy(model), tok, seed=3, max_running=8, scheduler="caller")
        try:
            outs.append([(r.output_ids, r.output_log_probs) for r in eng.generate(reqs)])
        finally:
            eng.close()
    assert outs[0] == outs[1]
    assert max(len(ids) for ids, _ in outs[0]) > 64  # one request crossed a chunk of numbers


@pytest.mark.parametrize("adapt", [True, False])
def test_small_steps_run_on_one_thread_only_where_the_engine_adapts(tiny, monkeypatch, adapt):
    """threads.py: a tiny model's decode (0.39 M multiply-adds per GEMM) runs on one thread when
    the engine adapts its threads (a sync run's in-process engine), on all otherwise; the
    process's count is restored after each step."""
    model, tok = tiny
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = ServingEngine(
            copy.deepcopy(model), tok, seed=3, scheduler="caller", adapt_threads=adapt
        )
        seen: list[int] = []
        decode = eng.runner.decode
        monkeypatch.setattr(
            eng.runner, "decode", lambda *a: seen.append(torch.get_num_threads()) or decode(*a)
        )
        eng.generate([_req(tok, "say a", max_new_tokens=4, stop_token_ids=None)])
        eng.close()
        assert seen and set(seen) == ({1} if adapt else {2})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def _longest_prefix_by_full_scan(table: SlotTable, tokens: list[int], exclude: set[int]):
    """best_match's answer by comparing every eligible slot in full (the rule it implements)."""
    limit, best, best_len = len(tokens) - 1, None, 0
    for s in table.slots:
        if (
            s.epoch != table.epoch
            or s.state == SlotState.FREE
            or s.index in exclude
            or not s.tokens
            or s.tokens[0] != tokens[0]
        ):
            continue
        n = min(common_prefix(s.tokens, tokens), limit)
        if n > best_len or (n == best_len and best is not None and s.state == SlotState.CACHED):
            best, best_len = s, n
    return (None, 0) if best_len < table.min_match else (best, best_len)


def test_best_match_skips_slots_by_one_token_and_still_finds_the_full_scans_slot():
    """Random tables (states, epochs, exclusions, ties, prefixes of a shared base): the slot and
    length best_match picks are the full scan's, including which CACHED slot wins a tie."""
    rng = random.Random(0)
    for _ in range(2000):
        table = SlotTable(rng.randrange(1, 20), min_match=rng.choice([1, 1, 3]))
        base = [rng.randrange(3) for _ in range(rng.randrange(8))]
        for s in table.slots:
            s.state = rng.choice(list(SlotState))
            s.epoch = rng.choice([0, 0, 0, 1])
            s.tokens = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(3) for _ in range(rng.randrange(8))
            ]
        query = base[: rng.randrange(len(base) + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(1, 8))
        ]
        exclude = {i for i in range(len(table.slots)) if rng.random() < 0.1}
        got = table.best_match(query, exclude)
        want = _longest_prefix_by_full_scan(table, query, exclude)
        assert got[0] is want[0] and got[1] == want[1]
