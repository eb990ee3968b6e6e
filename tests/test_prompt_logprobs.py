"""Prompt scoring (`logprob_start_len`, SGLang's layout): the engines score a request's own
input ids, the first entry a placeholder; the values are the trainer's log-probs of the same
tokens (bitwise in true on-policy mode, within the fp32 bound otherwise) at the temperature
asked for and echoed; bad scoring requests are 4xx."""

from __future__ import annotations

import httpx
import pytest
import torch

from miles_core.config import load_config
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.http import HttpEngine
from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams
from miles_core.run.training import build_trainer
from miles_core.train.batch import TrainBatch
from miles_core.types import Sample

PROMPT = [5, 9, 14, 3, 22]
RESPONSE = [40, 41, 7, 19, 2, 33]


def _score(engine, ids, start, temperature=None, max_new_tokens=0):
    req = GenerateRequest(
        input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
        logprob_start_len=start,
        input_logprob_temperature=temperature,
    )
    (resp,) = engine.generate([req])
    return resp


def _trainer_log_probs(tiny_dir, tmp_path, temperature: float, *sets) -> list[float]:
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            f"rollout.temperature={temperature}",
            f"checkpoint.root={tmp_path}",
            *sets,
        ],
    )
    trainer = build_trainer(cfg, tiny_dir)
    sample = Sample(
        group_index=0,
        index=0,
        rollout_id="r0",
        prompt="",
        tokens=PROMPT + RESPONSE,
        response_length=len(RESPONSE),
        loss_mask=[1] * len(RESPONSE),
        rollout_log_probs=[0.0] * len(RESPONSE),
    )
    batch = TrainBatch.from_samples([sample], None, temperature)
    try:
        return trainer.compute_log_probs(batch)[0]
    finally:
        trainer.close()


def test_the_layout_is_sglangs_a_placeholder_then_one_entry_per_scored_token(tiny):
    model, tok = tiny
    engine = EmbeddedEngine(model, tok)
    ids = PROMPT + RESPONSE
    for start in (0, 3, len(PROMPT) - 1, len(ids) - 1):
        meta = _score(engine, ids, start).meta_info
        entries = meta.input_token_logprobs
        assert [t for _, t, _ in entries] == ids[start:]
        assert entries[0][0] is None
        assert all(lp is not None and lp <= 0 for lp, _, _ in entries[1:])
        assert meta.input_logprob_temperature == 1.0
    assert _score(engine, ids, len(ids)).meta_info.input_token_logprobs == []
    assert _score(engine, ids, -1).meta_info.input_token_logprobs is None
    # a later start scores the same positions with the same values
    whole = _score(engine, ids, 0).meta_info.input_token_logprobs
    tail = _score(engine, ids, len(PROMPT) - 1).meta_info.input_token_logprobs
    assert tail[1:] == whole[len(PROMPT) :]
    # scoring rides along a generation too, over the input alone
    both = _score(engine, ids, len(PROMPT) - 1, max_new_tokens=3)
    assert len(both.output_ids) == 3 and both.meta_info.input_token_logprobs == tail


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_in_true_on_policy_mode_scores_are_the_trainers_log_probs_bitwise(
    tiny, tiny_dir, tmp_path, temperature
):
    model, tok = tiny
    own = _trainer_log_probs(tiny_dir, tmp_path, temperature, "train.true_on_policy=true")
    for engine in (
        EmbeddedEngine(model, tok, true_on_policy=True),
        ServingEngine(model, tok, true_on_policy=True, max_running=4, scheduler="caller"),
    ):
        meta = _score(engine, PROMPT + RESPONSE, len(PROMPT) - 1, temperature).meta_info
        assert [lp for lp, _, _ in meta.input_token_logprobs[1:]] == own
        assert meta.input_logprob_temperature == temperature


def test_otherwise_scores_are_within_the_fp32_bound_of_the_trainers(tiny, tiny_dir, tmp_path):
    """The bound: eps × hidden size × 64 (a reduction over the hidden dim, layers deep)."""
    model, tok = tiny
    own = torch.tensor(_trainer_log_probs(tiny_dir, tmp_path, 0.7))
    bound = torch.finfo(torch.float32).eps * model.config.hidden_size * 64
    for engine in (
        EmbeddedEngine(model, tok),
        ServingEngine(model, tok, max_running=4, scheduler="caller"),
    ):
        meta = _score(engine, PROMPT + RESPONSE, len(PROMPT) - 1, 0.7).meta_info
        got = torch.tensor([lp for lp, _, _ in meta.input_token_logprobs[1:]])
        assert (got - own).abs().max() <= bound
    # and the temperature is applied: scores at 1 differ
    at_one = _score(EmbeddedEngine(model, tok), PROMPT + RESPONSE, len(PROMPT) - 1)
    assert [lp for lp, _, _ in at_one.meta_info.input_token_logprobs[1:]] != got.tolist()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"logprob_start_len": 99}, "past the input"),
        ({"logprob_start_len": -2}, ">= -1"),
        ({"input_logprob_temperature": 0}, "input_logprob_temperature"),
        ({"input_logprob_temperature": -1.5}, "input_logprob_temperature"),
        ({"top_logprobs_num": -3}, "top_logprobs_num"),
        ({"top_logprobs_num": 10**9}, "exceeds the vocabulary"),
        ({"token_ids_logprob": [1, 10**6]}, "token_ids_logprob: token id"),
    ],
)
def test_a_bad_scoring_request_is_a_400_naming_the_field(session_stack, change, message):
    engine, _ = session_stack
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
    } | change
    r = httpx.post(f"{engine.url}/generate", json=body, timeout=30)
    assert r.status_code == 400 and message in r.text


def test_an_engine_server_answers_scoring_in_the_batch_form(session_stack, tiny):
    """Over HTTP, one body for several sequences (the client's batch payload), each with its
    own start; the values match the in-process engine's within the fp32 bound."""
    server, _ = session_stack
    model, tok = tiny
    ids = [PROMPT + RESPONSE, PROMPT[:3] + RESPONSE[:2]]
    reqs = [
        GenerateRequest(
            input_ids=x,
            sampling_params=SamplingParams(max_new_tokens=0),
            logprob_start_len=k,
            input_logprob_temperature=0.5,
        )
        for x, k in zip(ids, (len(PROMPT) - 1, 0), strict=True)
    ]
    engine = HttpEngine(server.url, batch_size=len(reqs))
    try:
        got = engine.generate(reqs)
    finally:
        engine.close()
    local = EmbeddedEngine(model, tok).generate(reqs)
    bound = torch.finfo(torch.float32).eps * model.config.hidden_size * 64
    for g, want, x, k in zip(got, local, ids, (len(PROMPT) - 1, 0), strict=True):
        entries = g.meta_info.input_token_logprobs
        assert [t for _, t, _ in entries] == x[k:] and entries[0][0] is None
        assert g.meta_info.input_logprob_temperature == 0.5
        values = torch.tensor([lp for lp, _, _ in entries[1:]])
        expected = torch.tensor([lp for lp, _, _ in want.meta_info.input_token_logprobs[1:]])
        assert (values - expected).abs().max() <= bound


def test_scoring_with_an_adapter_is_refused(tiny):
    model, tok = tiny
    engine = EmbeddedEngine(model, tok)
    req = GenerateRequest(input_ids=PROMPT, logprob_start_len=0, lora_path="a")
    with pytest.raises(EngineRequestError, match="scoring input ids with an adapter"):
        engine.validate(req)


def test_top_logprobs_and_given_ids_are_the_trainers_log_softmax(tiny, tiny_dir, tmp_path):
    """With top_logprobs_num n each scored position lists the n largest entries of the
    trainer's log-softmax row, and token_ids_logprob its entries at those ids (bitwise in true
    on-policy mode); the first position is a placeholder."""
    model, tok = tiny
    ids = PROMPT + RESPONSE
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    rows = full[len(PROMPT) - 1 : len(ids) - 1]
    given = [3, 40, 7]
    for engine in (
        EmbeddedEngine(model, tok, true_on_policy=True),
        ServingEngine(model, tok, max_running=4, scheduler="caller"),
    ):
        req = GenerateRequest(
            input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens=0),
            logprob_start_len=len(PROMPT) - 1,
            top_logprobs_num=4,
            token_ids_logprob=given,
        )
        (resp,) = engine.generate([req])
        meta = resp.meta_info
        assert meta.input_top_logprobs[0] is None and meta.input_token_ids_logprobs[0] is None
        sampled = torch.tensor([lp for lp, _, _ in meta.input_token_logprobs[1:]])
        top = meta.input_top_logprobs[1:]
        at = meta.input_token_ids_logprobs[1:]
        assert len(top) == len(at) == len(RESPONSE)
        for j, row in enumerate(rows):
            assert [i for _, i, _ in top[j]] == row.topk(4).indices.tolist()
            assert [i for _, i, _ in at[j]] == given
            values = torch.tensor([lp for lp, _, _ in at[j]])
            assert torch.allclose(values, row[given], rtol=0, atol=1e-5)
            # one row of numbers: the sampled token's entry is the same value wherever it shows
            if RESPONSE[j] in given:
                assert values[given.index(RESPONSE[j])] == sampled[j]


def test_top_k_past_the_vocabulary_and_ids_outside_it_are_refused(tiny):
    model, tok = tiny
    engine = EmbeddedEngine(model, tok)
    vocab = model.config.vocab_size
    for change, message in [
        ({"top_logprobs_num": vocab + 1}, "exceeds the vocabulary"),
        ({"token_ids_logprob": [1, vocab]}, "token_ids_logprob: token id"),
    ]:
        req = GenerateRequest(input_ids=PROMPT, logprob_start_len=0, **change)
        with pytest.raises(EngineRequestError, match=message):
            engine.validate(req)
