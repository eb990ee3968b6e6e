import copy

import pytest
import torch

from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.cpu.hf_forward import HFForward
from miles_core.engines.cpu.loading import PackedWeightsDiffer
from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams
from miles_core.rollout.rollout_fn import encode_prompt


@pytest.fixture(params=[True, False], ids=["runner", "hf_modules"])
def engine(tiny, request):
    """Both forwards of the embedded engine: the lean runner (Qwen3) and the model's modules."""
    model, tok = tiny
    return EmbeddedEngine(copy.deepcopy(model), tok, seed=7, fast=request.param)


def _req(tok, text="say a", **sp):
    return GenerateRequest(input_ids=encode_prompt(tok, text), sampling_params=SamplingParams(**sp))


def test_logprobs_match_a_full_forward_recompute(engine, tiny):
    model, tok = tiny
    # repeated prompts (a GRPO group's) are prefilled once and their cache rows repeated
    texts = ["say a", "reverse abcdefgh", "say a", "1+2=", "go", "say a"]
    reqs = [_req(tok, t, max_new_tokens=12) for t in texts]
    out = engine.generate(reqs)
    assert out[0].output_ids != out[2].output_ids  # the group's samples diverge
    for req, resp in zip(reqs, out, strict=True):
        full = torch.tensor([req.input_ids + resp.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits[0].float(), -1)
        p = len(req.input_ids)
        ref = lp[p - 1 : p - 1 + len(resp.output_ids)].gather(
            1, torch.tensor(resp.output_ids)[:, None]
        )[:, 0]
        assert torch.allclose(ref, torch.tensor(resp.output_log_probs), atol=1e-5, rtol=0)
        assert len(resp.output_ids) == 12 and resp.meta_info.finish_reason.type == "length"


def test_temperature_scales_the_reported_logprobs(engine, tiny):
    model, tok = tiny
    req = _req(tok, max_new_tokens=6, temperature=0.5)
    resp = engine.generate([req])[0]
    full = torch.tensor([req.input_ids + resp.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0].float() / 0.5, -1)
    p = len(req.input_ids)
    ref = lp[p - 1 : p - 1 + 6].gather(1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(resp.output_log_probs), atol=1e-5, rtol=0)


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus(engine, tiny):
    model, tok = tiny
    req = _req(tok, max_new_tokens=8, top_k=1)
    resp = engine.generate([req])[0]
    ids = list(req.input_ids)
    with torch.no_grad():
        for t in resp.output_ids:
            assert int(model(torch.tensor([ids])).logits[0, -1].argmax()) == t
            ids.append(t)
    # a tiny top-p keeps only the most likely token, so it is greedy too
    assert (
        engine.generate([_req(tok, max_new_tokens=8, top_p=1e-6)])[0].output_ids == resp.output_ids
    )


def test_stop_token_ends_the_sequence_and_is_kept(engine, tiny):
    _, tok = tiny
    first = engine.generate([_req(tok, max_new_tokens=8, top_k=1)])[0].output_ids
    stop = first[2]
    resp = engine.generate([_req(tok, max_new_tokens=8, top_k=1, stop_token_ids=[stop])])[0]
    assert resp.output_ids == first[: first.index(stop) + 1]
    assert (
        resp.meta_info.finish_reason.type == "stop" and resp.meta_info.finish_reason.matched == stop
    )


@pytest.mark.parametrize("fast", [True, False], ids=["runner", "hf_modules"])
def test_batched_rows_with_different_prompt_lengths_equal_single_runs(tiny, fast):
    model, tok = tiny
    texts = ["a", "reverse abcdefgh", "a", "12+345=", "reverse abcdefgh"]
    reqs = [_req(tok, t, max_new_tokens=10, top_k=1) for t in texts]
    batched = EmbeddedEngine(model, tok, fast=fast).generate(reqs)
    for req, b in zip(reqs, batched, strict=True):
        single = EmbeddedEngine(model, tok, fast=fast).generate([req])[0]
        assert single.output_ids == b.output_ids
        assert torch.allclose(
            torch.tensor(single.output_log_probs), torch.tensor(b.output_log_probs), atol=1e-5
        )


def test_same_seed_same_samples(tiny):
    model, tok = tiny
    reqs = [_req(tok, max_new_tokens=10) for _ in range(4)]
    a = EmbeddedEngine(model, tok, seed=1).generate(reqs)
    b = EmbeddedEngine(model, tok, seed=1).generate(reqs)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


def test_weight_version_is_carried(engine, tiny):
    _, tok = tiny
    engine.set_weight_version(3)
    assert engine.generate([_req(tok, max_new_tokens=2)])[0].meta_info.weight_version == "3"


BAD_REQUESTS = [  # (input ids, sampling params, the reason the engine gives); both engines
    ([1, 2, 9999], {}, "outside the vocabulary"),
    ([], {}, "empty"),
    ([5, 6], {"max_new_tokens": -1}, "max_new_tokens"),
    ([5] * 500, {"max_new_tokens": 100}, "exceeds the context length"),
]


@pytest.mark.parametrize("ids, sp, message", BAD_REQUESTS)
def test_bad_requests_are_refused_with_a_reason(engine, ids, sp, message):
    with pytest.raises(EngineRequestError, match=message):
        engine.generate([GenerateRequest(input_ids=ids, sampling_params=SamplingParams(**sp))])


def test_loads_named_tensors_and_rejects_unknown_names(engine):
    name, t = next(iter(engine.named_tensors().items()))
    new = torch.randn_like(t)
    assert engine.update_weights_from_tensor([(name, new)]) == new.numel() * 4
    assert torch.equal(engine.named_tensors()[name], new)
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights_from_tensor([("nope.weight", new)])


def test_generates_with_pushed_weights_and_a_stale_copy_fails_the_weights_check(engine, tiny):
    _, tok = tiny
    req = _req(tok, "reverse abc", max_new_tokens=6)
    engine.generate([req])  # the runner packs its copies of the first weights
    pushed = {n: t + 0.05 * torch.randn_like(t) for n, t in engine.named_tensors().items()}
    engine.update_weights_from_tensor(pushed.items())
    resp = engine.generate([req])[0]
    with torch.no_grad():
        full = torch.tensor([req.input_ids + resp.output_ids])
        lp = torch.log_softmax(engine.model(full).logits[0].float(), -1)
    p = len(req.input_ids)
    ref = lp[p - 1 : p + 5].gather(1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(resp.output_log_probs), atol=1e-5, rtol=0)
    engine.weights_checksum()  # copies and tensors agree
    with torch.no_grad():  # a write that bypasses the engine: the copies go stale
        engine.model.model.norm.weight.add_(1.0)
    if isinstance(engine.forward, HFForward):  # nothing derived: the write is what generates
        engine.weights_checksum()
    else:
        with pytest.raises(PackedWeightsDiffer, match="lm_head"):
            engine.weights_checksum()


def test_temperature_zero_is_greedy_and_bad_sampling_params_are_refused(engine, tiny):
    from pydantic import ValidationError

    _, tok = tiny
    greedy = engine.generate([_req(tok, max_new_tokens=8, temperature=0)])[0]
    assert (
        greedy.output_ids == engine.generate([_req(tok, max_new_tokens=8, top_k=1)])[0].output_ids
    )
    for bad in ({"top_p": 0}, {"top_p": 1.5}, {"temperature": -1}, {"top_k": -2}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    with pytest.raises(EngineRequestError, match="stop token id 999"):
        engine.generate([_req(tok, stop_token_ids=[999])])


def test_a_config_the_runner_lacks_falls_back_to_the_model_modules(tiny):
    from transformers import Qwen3ForCausalLM

    from miles_core.models.qwen3.runner import Qwen3Runner
    from miles_core.models.qwen3.runner_forward import RunnerForward

    model, tok = tiny
    assert isinstance(EmbeddedEngine(model, tok).forward, RunnerForward)
    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    scaled = Qwen3ForCausalLM(config).eval()
    engine = EmbeddedEngine(scaled, tok)
    assert isinstance(engine.forward, HFForward)
    req = _req(tok, "reverse abc", max_new_tokens=4)
    resp = engine.generate([req])[0]
    with torch.no_grad():
        full = torch.tensor([req.input_ids + resp.output_ids])
        lp = torch.log_softmax(scaled(full).logits[0].float(), -1)
    p = len(req.input_ids)
    ref = lp[p - 1 : p + 3].gather(1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(resp.output_log_probs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        Qwen3Runner(scaled, slots=1)


def test_a_long_prompt_with_a_short_limit_beside_a_long_generation(engine, tiny):
    """The finished row keeps being fed while the other generates, past its own limit."""
    model, tok = tiny
    long = _req(tok, "reverse " + "abcdefgh" * 6, max_new_tokens=2)
    short = _req(tok, "go", max_new_tokens=60)
    out = engine.generate([long, short])
    assert [len(r.output_ids) for r in out] == [2, 60]
    for req, resp in zip((long, short), out, strict=True):
        with torch.no_grad():
            full = torch.tensor([req.input_ids + resp.output_ids])
            lp = torch.log_softmax(model(full).logits[0].float(), -1)
        p, n = len(req.input_ids), len(resp.output_ids)
        ref = lp[p - 1 : p - 1 + n].gather(1, torch.tensor(resp.output_ids)[:, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(resp.output_log_probs), atol=1e-5, rtol=0)
