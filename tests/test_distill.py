"""On-policy distillation: teachers served as engines score the student's own token ids, the
difference of log-probs joins the advantage after the estimator (`opd`), with a teacher equal to
the student the train step is bitwise the step without it, and every way a teacher can fail a
sample fails that sample with the reason while the run goes on."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from fastapi import FastAPI

from miles_core.distill import top_k
from miles_core.distill.scoring import (
    TeacherAnswerError,
    likeliest,
    position_entries,
    scoring_request,
    teacher_log_probs,
)
from miles_core.distill.teachers import ERROR, TeacherFleet
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.wire import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    SamplingParams,
)
from miles_core.models import build_model, save_hf_dir
from miles_core.run import runtime
from miles_core.run.preflight import preflight
from miles_core.run.training import build_trainer
from miles_core.token_fields import load_token_fields
from miles_core.train.batch import TrainBatch
from miles_core.types import Sample, SampleGroup, Status
from tests.runs import AGENTIC, tiny_say_a
from tests.servers import served

_config = tiny_say_a


def _sample(prompt=(5, 6, 7), response=(8, 9, 10)) -> Sample:
    return Sample(
        group_index=0,
        index=0,
        rollout_id="s0-g0-0",
        prompt="",
        tokens=[*prompt, *response],
        response_length=len(response),
        loss_mask=[1] * len(response),
        rollout_log_probs=[-1.0] * len(response),
        reward=1.0,
        status=Status.COMPLETED,
    )


def _answer(entries, temperature=None) -> GenerateResponse:
    extra = {} if temperature is None else {"input_logprob_temperature": temperature}
    return GenerateResponse(
        output_ids=[],
        meta_info=MetaInfo(
            finish_reason=FinishReason(type="length", length=0),
            prompt_tokens=6,
            completion_tokens=0,
            weight_version="0",
            input_token_logprobs=entries,
            **extra,
        ),
    )


def test_the_request_sends_the_students_ids_from_the_last_prompt_token():
    s = _sample()
    req = scoring_request(s, 0.7)
    assert req.input_ids == s.tokens and req.logprob_start_len == 2
    assert req.sampling_params.max_new_tokens == 0 and req.input_logprob_temperature == 0.7
    good = [(None, 7, None), (-0.5, 8, None), (-1.0, 9, None), (-2.0, 10, None)]
    assert teacher_log_probs(s, _answer(good), 1.0).tolist() == [-0.5, -1.0, -2.0]


@pytest.mark.parametrize(
    "entries, temperature, message",
    [
        (None, 0.7, "no meta_info.input_token_logprobs"),
        ([(None, 7, None), (-0.5, 8, None)], 0.7, "2 input log-probs for a 3-token"),
        ([(-0.1, 7, None), (-0.5, 8, None), (-1, 9, None), (-2, 10, None)], 0.7, "placeholder"),
        ([(None, 7, None), (-0.5, 8, None), (-1, 4, None), (-2, 10, None)], 0.7, "position 1"),
        ([(None, 7, None), (-0.5, 8, None), (float("nan"), 9, None), (-2, 10, None)], 0.7, "nan"),
        ([(None, 7, None), (-0.5, 8, None), (3.0, 9, None), (-2, 10, None)], 0.7, "3.0"),
        # an SGLang server says nothing: it scored at 1
        ([(None, 7, None), (-0.5, 8, None), (-1, 9, None), (-2, 10, None)], None, "at 0.7"),
    ],
    ids=["missing", "short", "offset", "other-ids", "nan", "positive", "temperature"],
)
def test_an_answer_that_must_not_be_trained_on_is_refused_saying_why(entries, temperature, message):
    with pytest.raises(TeacherAnswerError, match=message):
        teacher_log_probs(_sample(), _answer(entries, temperature), 0.7)


@pytest.mark.slow
def test_with_the_student_as_teacher_the_step_is_bitwise_the_step_without(tmp_path):
    """True on-policy: the teacher's engine scores the trainer's bits, so Â_t − A_t =
    −coef · (π_old − π_teacher) is exactly 0: the same loss and the same weights after the step,
    and a KL of exactly 0; so is the top-k KL of every position (the student's engine and the
    teacher's give the same rows)."""
    tok_sets = ["train.true_on_policy=true"]
    base = _config(tmp_path / "a", *tok_sets)
    init = runtime.prepare_model_dir(base, tmp_path / "init")
    runs = {}
    for name, sets in {
        "rl": [],
        "rl+opd": [f"train.distill={{teachers: {{default: {init}}}}}"],
        "rl+opd-top-k": [
            f"train.distill={{teachers: {{default: {init}}}, top_k: 4, top_k_strategy: union}}"
        ],
    }.items():
        cfg = _config(tmp_path / name, *tok_sets, *sets)
        rt = runtime.RLRuntime(cfg, init, None)
        try:
            result = rt.rollout(0)
            metrics = rt.train(result)
            weights = {n: p.detach().clone() for n, p in rt.trainer.model.named_parameters()}
            runs[name] = (result, metrics, weights)
            teacher = rt.teachers.teachers["default"].process if rt.teachers else None
        finally:
            rt.close()
    _, rl, w_rl = runs["rl"]
    for name in ("rl+opd", "rl+opd-top-k"):
        result, opd, w_opd = runs[name]
        assert result.metrics["distill/kl"] == 0.0
        assert result.metrics["distill/failed_samples"] == 0
        assert all("teacher_log_probs" in s.token_fields for s in result.samples)
        assert opd["train/loss"] == rl["train/loss"], name
        assert all(torch.equal(w_rl[n], w_opd[n]) for n in w_rl), name
    top_k_kl = [s.token_fields["teacher_topk_kl"] for s in runs["rl+opd-top-k"][0].samples]
    assert all(not kl.any() for kl in top_k_kl)  # every position's KL over its set: 0.0
    assert teacher.proc.poll() is not None  # the run stopped the teacher's engine server


def test_each_sample_goes_to_its_rows_teacher_and_an_unknown_one_fails_it(tmp_path, session_stack):
    proc, _ = session_stack  # the session's shared engine server, as a teacher by URL
    cfg = _config(tmp_path, f"train.distill={{teachers: {{math: {proc.url}}}}}")
    fleet = TeacherFleet(cfg.train.distill, 1.0, tmp_path)
    try:
        routed, unknown, unnamed = _sample(), _sample(), _sample()
        routed.metadata["row"] = {"teacher": "math"}
        unknown.metadata["row"] = {"teacher": "poetry"}
        fleet.score(SampleGroup(group_index=0, samples=[routed, unknown, unnamed]))
        assert routed.status == Status.COMPLETED
        lp = routed.token_fields["teacher_log_probs"]
        assert lp.shape == (3,) and np.all(lp < 0)
        assert "'poetry'" in unknown.metadata[ERROR] and unknown.status == Status.FAILED
        assert "'default'" in unnamed.metadata[ERROR] and unnamed.loss_mask == [0, 0, 0]
        m = fleet.metrics([routed, unknown, unnamed])
        assert m["distill/failed_samples"] == 2
        assert m["distill/kl"] == pytest.approx(float(np.mean(-1.0 - lp)), rel=1e-6)
    finally:
        fleet.close()


def test_a_teacher_lost_mid_run_fails_its_samples_with_the_reason(tmp_path):
    """A teacher that answered at start and is gone when a group is scored."""
    app = FastAPI()
    app.get("/get_server_info")(lambda: {"version": "teacher"})
    app.get("/health")(lambda: {})
    with served(app) as url:
        cfg = _config(tmp_path, f"train.distill={{teachers: {{default: {url}}}}}")
        fleet = TeacherFleet(cfg.train.distill, 1.0, tmp_path)
    try:
        s, other = _sample(), _sample()
        fleet.score(SampleGroup(group_index=0, samples=[s, other]))
        assert s.status == other.status == Status.FAILED
        assert f"teacher default at {url} did not score it" in s.metadata[ERROR]
    finally:
        fleet.close()


def test_an_unreachable_teacher_is_a_clear_error_at_start(tmp_path):
    cfg = _config(tmp_path, "train.distill={teachers: {default: 'http://127.0.0.1:9'}}")
    with pytest.raises(RuntimeError, match="teachers.default: the teacher at http://127.0.0.1:9"):
        TeacherFleet(cfg.train.distill, 1.0, tmp_path)


@pytest.mark.parametrize("what", ["vocabulary", "tokenizer", "row", "missing", "top_k", "kd_top_k"])
def test_a_teacher_that_cannot_score_the_students_ids_is_refused_before_start(
    tmp_path, tiny_dir, what
):
    teacher, sets = tmp_path / "teacher", []
    if what in ("top_k", "kd_top_k"):  # more tokens per position than the vocabulary has
        teacher = tiny_dir
        vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
        sets = [f"train.distill.{what}={vocab + 1}"]
        message = f"train.distill.{what} {vocab + 1} exceeds the vocabulary"
    elif what == "vocabulary":
        model, tok = build_model("tiny", seed=0)
        model.resize_token_embeddings(model.config.vocab_size + 8)
        save_hf_dir(model, tok, teacher)
        message = "vocabulary of"
    elif what == "tokenizer":  # same size, two tokens' ids swapped
        save_hf_dir(*build_model("tiny", seed=0), teacher)
        vocab_file = json.loads((teacher / "tokenizer.json").read_text())
        vocab = vocab_file["model"]["vocab"]
        a, b = list(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (teacher / "tokenizer.json").write_text(json.dumps(vocab_file))
        message = "other ids than the student's"
    elif what == "row":
        teacher = tiny_dir
        data = tmp_path / "rows.jsonl"
        data.write_text(json.dumps({"prompt": "hi", "label": "a", "teacher": "poetry"}) + "\n")
        sets = [f"data.path={data}"]
        message = "row 1 names teacher 'poetry'"
    else:
        message = "no config.json"
    cfg = _config(tmp_path, f"train.distill={{teachers: {{default: {teacher}}}}}", *sets)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        preflight(cfg)


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.distill={teachers: {default: x}, top_k: -1}"], "greater than or equal to 0"),
        (["train.distill={teachers: {default: x}, temperature: 0.5}"], "must equal rollout"),
        (["train.distill={teachers: {}}"], "at least one teacher"),
        (["train.distill={teachers: {default: x}, coef: 0}"], "leaves nothing of the teacher"),
        (
            ["train.distill={teachers: {default: x}, coef: 0, top_k: 2, kd_top_k: 2}"],
            "coef 0 turns off",
        ),
        (
            ["train.distill={teachers: {default: x}, kd_top_k: 2}", "train.loss=sft"],
            "train.loss is sft",
        ),
        (
            ["train.distill={teachers: {default: x}, top_k: 2}", "train.lora.rank=4"],
            "with train.lora",
        ),
        (["train.advantage_transforms={nope: {}}"], "unknown advantage transform 'nope'"),
    ],
)
def test_bad_distillation_settings_are_refused_at_config_time(tmp_path, sets, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, *sets)


# a run's settings beside the teacher: text (fully async, true on-policy: a teacher equal to the
# starting student scores its bits) and agentic (sandboxed terminal episodes, several turns)
FLOW_RUNS = {
    "fully_async": [
        "train.true_on_policy=true",
        "rollout.mode=fully_async",
        "rollout.prompts_per_step=4",
    ],
    "agentic": AGENTIC,
}


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.parametrize("kind", FLOW_RUNS)
def test_a_run_with_a_teacher_finishes_through_the_flow_with_the_kl_each_step(
    prefect_server, tmp_path, monkeypatch, kind
):
    """`miles train`'s flow with the starting model as the teacher: the run FINISHES, every
    sample of every step is scored (in the producer, as groups complete; in agent runs every
    turn's tokens of the session sample), and MLflow has distill/kl at each step: 0.0 at the
    first in true on-policy mode, then moving as RL moves the student."""
    monkeypatch.chdir(tmp_path)
    from mlflow.tracking import MlflowClient

    from flows.rl_train import rl_train

    steps = 3
    base = [
        "rollout.engine=server",
        "rollout.engine_options.threads=1",
        "weight_sync.transport=shared_memory",
        f"train.num_steps={steps}",
        "tracking.experiment=distill",
        *FLOW_RUNS[kind],
    ]
    init = runtime.prepare_model_dir(_config(tmp_path, *base), tmp_path / "init")
    cfg = _config(
        tmp_path, *base, f"model.path={init}", f"train.distill={{teachers: {{default: {init}}}}}"
    )
    state = rl_train(cfg, return_state=True)
    assert state.is_completed()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("distill").experiment_id])
    assert run.info.status == "FINISHED"

    def history(key):
        return [
            m.value
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]

    kl = history("distill/kl")
    assert len(kl) == steps and all(math.isfinite(v) for v in kl)
    assert history("distill/failed_samples") == [0.0] * steps
    if kind == "fully_async":
        assert kl[0] == 0.0 and kl[-1] != 0.0
    else:  # the teacher's and the rollout's forwards differ by rounding alone at the start
        assert abs(kl[0]) < 1e-3
        assert history("agent/turns_episodes") and min(history("agent/turns_mean")) >= 1.0


def test_the_top_k_sets_and_their_renormalised_weights():
    s = {1: math.log(0.5), 2: math.log(0.3), 3: math.log(0.1), 4: math.log(0.05)}
    t = {1: math.log(0.2), 2: math.log(0.1), 3: math.log(0.4), 4: math.log(0.25)}
    s_top, t_top = [1, 2], [3, 4]
    assert top_k.token_set("only_student", s_top, t_top) == [1, 2]
    assert top_k.token_set("only_teacher", s_top, t_top) == [3, 4]
    assert top_k.token_set("intersection", s_top, [2, 3]) == [2]
    assert top_k.token_set("union", s_top, [2, 3]) == [1, 2, 3]
    # only_student: w = (0.5, 0.3) / 0.8
    want = 0.5 / 0.8 * math.log(0.5 / 0.2) + 0.3 / 0.8 * math.log(0.3 / 0.1)
    assert top_k.position_kl("only_student", s, t, s_top, t_top) == pytest.approx(want)
    assert top_k.position_kl("intersection", s, t, s_top, t_top) == 0.0  # empty set
    assert top_k.position_kl("union", s, s, s_top, t_top) == 0.0  # teacher == student
    with pytest.raises(KeyError, match="teacher's log-probs lack token ids"):
        top_k.position_kl("union", s, {1: -1.0}, s_top, t_top)


def _scored(fleet: TeacherFleet) -> Sample:
    """One sample scored by `fleet` (then closed), which must have succeeded."""
    try:
        s = _sample(prompt=(5, 9, 14, 3), response=(40, 41, 7, 19, 2))
        fleet.score(SampleGroup(group_index=0, samples=[s]))
    finally:
        fleet.close()
    assert s.status == Status.COMPLETED, s.metadata
    return s


@pytest.mark.parametrize("strategy", top_k.STRATEGIES)
def test_the_top_k_kl_is_each_positions_kl_over_its_set(tmp_path, session_stack, strategy):
    """The teacher (the shared engine server's tiny model) and a student of another seed (an
    in-process engine): each position's KL over the strategy's set equals the one computed from
    both models' full log-softmax rows, within fp32 rounding."""
    server, _ = session_stack
    student_model, tok = build_model("tiny", seed=1)
    teacher_model, _ = build_model("tiny", seed=0)
    cfg = _config(
        tmp_path,
        f"train.distill={{teachers: {{default: {server.url}}}, top_k: 3, "
        f"top_k_strategy: {strategy}}}",
    )
    s = _scored(
        TeacherFleet(cfg.train.distill, 1.0, tmp_path, student=EmbeddedEngine(student_model, tok))
    )
    got = s.token_fields["teacher_topk_kl"]
    with torch.no_grad():
        rows = [
            torch.log_softmax(m(input_ids=torch.tensor([s.tokens])).logits[0].double(), -1)
            for m in (student_model, teacher_model)
        ]
    p = s.prompt_length
    for j in range(s.response_length):
        ls, lt = rows[0][p - 1 + j], rows[1][p - 1 + j]
        ids = top_k.token_set(strategy, ls.topk(3).indices.tolist(), lt.topk(3).indices.tolist())
        w = torch.softmax(ls[ids], -1)
        want = float((w * (ls[ids] - lt[ids])).sum()) if ids else 0.0
        assert got[j] == pytest.approx(want, abs=1e-4), (j, ids)
    assert np.any(got != 0)


def test_the_kd_fields_are_the_teachers_likeliest_tokens_at_each_position(tmp_path, session_stack):
    """kd_top_k: the teacher's k likeliest ids and their log-probs at each response position,
    in order, equal to its full log-softmax rows within fp32 rounding."""
    server, _ = session_stack
    teacher_model, _ = build_model("tiny", seed=0)
    cfg = _config(
        tmp_path, f"train.distill={{teachers: {{default: {server.url}}}, kd_top_k: 3, coef: 0}}"
    )
    assert cfg.train.loss == "distill" and cfg.train.loss_options.kd_top_k == 3
    assert "opd" not in cfg.train.advantage_transforms  # coef 0: no advantage term
    s = _scored(TeacherFleet(cfg.train.distill, 1.0, tmp_path))
    ids, lps = s.token_fields["teacher_top3_ids"], s.token_fields["teacher_top3_log_probs"]
    assert ids.shape == lps.shape == (5, 3) and ids.dtype == np.int32
    with torch.no_grad():
        rows = torch.log_softmax(teacher_model(input_ids=torch.tensor([s.tokens])).logits[0], -1)
    for j in range(s.response_length):
        want = rows[s.prompt_length - 1 + j].topk(3)
        assert ids[j].tolist() == want.indices.tolist()
        assert lps[j] == pytest.approx(want.values.numpy(), abs=1e-4)


def test_the_kd_term_is_the_kl_from_the_teachers_renormalised_top_k():
    from miles_core.train.losses.distill import kd_term

    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    # the teacher equal to the student over its whole vocabulary: 0, and no gradient
    same = kd_term(student, student.detach())
    (grad,) = torch.autograd.grad(same.sum(), logits)
    assert same.abs().max() < 1e-12 and grad.abs().max() < 1e-12
    # over a teacher's top 2 of [0.5, 0.3, 0.2]: w = (0.625, 0.375), against a student's rows
    teacher = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=torch.float64))
    s = torch.log(torch.tensor([[[0.25, 0.25]]], dtype=torch.float64))
    want = 0.625 * math.log(0.625 / 0.25) + 0.375 * math.log(0.375 / 0.25)
    assert float(kd_term(s, teacher)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("term", ["advantage", "kd"])
def test_pure_distillation_closes_the_gap_to_the_teacher_on_its_tokens(tmp_path, tiny_dir, term):
    """The sign and the plumbing of both terms: a student trained on tokens a sharp teacher
    chose, with estimator none and Â = −(log π_old − log π_teacher) (advantage), or with the
    dense term over the teacher's top 4 alone (kd), raises their log-probs toward the teacher's
    (a flipped sign would push them down)."""
    teacher, tok = build_model("tiny", seed=1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # peaked: its own tokens get log-probs near 0
    engine = EmbeddedEngine(teacher, tok)
    prompts = [[5 + i, 9, 14, 3] for i in range(8)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    outs = engine.generate([GenerateRequest(input_ids=p, sampling_params=greedy) for p in prompts])
    samples = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        s = _sample(prompt=p, response=out.output_ids)
        s.index, s.group_index, s.rollout_id = i, i // 4, f"r{i}"
        (scored,) = engine.generate([scoring_request(s, 1.0, 4)])
        s.token_fields["teacher_log_probs"] = teacher_log_probs(s, scored, 1.0)
        if term == "kd":
            top = position_entries(scored, "input_top_logprobs", s)
            ids, log_probs = likeliest(top, 4)
            s.token_fields.update(teacher_top4_ids=ids, teacher_top4_log_probs=log_probs)
        samples.append(s)
    dense = ", coef: 0, kd_top_k: 4" if term == "kd" else ""
    cfg = _config(
        tmp_path,
        "train.advantage_estimator=none",
        f"train.distill={{teachers: {{default: {tiny_dir}}}{dense}}}",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
    )
    load_token_fields(cfg.rollout.token_fields)  # as a run declares them at its start
    trainer = build_trainer(cfg, tiny_dir)

    def gap() -> float:
        batch = TrainBatch.from_samples(samples, None, 1.0)
        own = trainer.compute_log_probs(batch)
        pairs = zip(own, samples, strict=True)
        return float(np.mean([np.mean(o - s.token_fields["teacher_log_probs"]) for o, s in pairs]))

    try:
        before = gap()
        for _ in range(8):
            batch = TrainBatch.from_samples(samples, [0.0] * len(samples), 1.0)
            batch.advantage_transforms = dict(cfg.train.advantage_transforms)
            batch.old_is_current = True
            trainer.train_step(batch, loss=cfg.train.loss)
        after = gap()
    finally:
        trainer.close()
    assert before < -1.0 and before / 2 < after < 0.0, (before, after)
