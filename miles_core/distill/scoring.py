"""One teacher's scoring of one sample: the request (the student's exact token ids, SGLang's
`logprob_start_len` at the last prompt token, nothing generated) and the checks its answer must
pass before its log-probs are trained on.

The answer is SGLang's `input_token_logprobs` from the last prompt position on: a placeholder
(no context is scored for it), then one entry per response token. Each entry must name the
sample's own token id (a teacher that re-tokenized, or scored another sequence, is caught
here), hold a finite log-prob ≤ 0, and the teacher must have scored at the student's
temperature (an answer that does not say is SGLang's: temperature 1)."""

from __future__ import annotations

import math

import numpy as np

from miles_core.engines.wire import GenerateRequest, GenerateResponse, SamplingParams
from miles_core.types import Sample

# a log-softmax rounds to at most a few ulps above 0
_ABOVE_ZERO = 1e-5


class TeacherAnswerError(ValueError):
    """A teacher's answer that must not be trained on; the message says why."""


def scoring_request(
    sample: Sample, temperature: float, top_k: int = 0, token_ids: list[int] | None = None
) -> GenerateRequest:
    """The scoring of `sample`'s response; with `top_k`, each position's k likeliest tokens
    too, with `token_ids`, the log-probs of those ids at every position."""
    return GenerateRequest(
        input_ids=list(sample.tokens),
        sampling_params=SamplingParams(max_new_tokens=0),
        logprob_start_len=sample.prompt_length - 1,
        input_logprob_temperature=temperature,
        top_logprobs_num=top_k,
        token_ids_logprob=token_ids,
    )


def position_entries(resp: GenerateResponse, key: str, sample: Sample) -> list[dict[int, float]]:
    """Per response token, token id → log-prob from the answer's per-position list `key`
    (`input_top_logprobs`, `input_token_ids_logprobs`); the placeholder dropped."""
    rows = getattr(resp.meta_info, key)
    n = sample.response_length
    if rows is None or len(rows) != n + 1:
        got = "none" if rows is None else f"{len(rows)} positions"
        raise TeacherAnswerError(f"the answer's {key} has {got}, expected {n + 1}")
    out = []
    for row in rows[1:]:
        values = {int(i): lp for lp, i, _ in row or []}
        if any(v is None or not math.isfinite(v) or v > _ABOVE_ZERO for v in values.values()):
            raise TeacherAnswerError(f"the answer's {key} holds a log-prob that is not ≤ 0")
        out.append(values)
    return out


def teacher_log_probs(sample: Sample, resp: GenerateResponse, temperature: float) -> np.ndarray:
    """The teacher's log-prob of each response token of `sample` (float32 [R]), from its answer
    to `scoring_request`; TeacherAnswerError saying what is wrong with the answer."""
    meta = resp.meta_info
    entries = meta.input_token_logprobs
    if entries is None:
        raise TeacherAnswerError(
            "the teacher's answer has no meta_info.input_token_logprobs (does it take SGLang's "
            "logprob_start_len?)"
        )
    scored = meta.input_logprob_temperature or 1.0
    if scored != temperature:
        raise TeacherAnswerError(
            f"the teacher scored at temperature {scored:g}, the student samples at "
            f"{temperature:g} (an SGLang server scores input positions at 1 only)"
        )
    n = sample.response_length
    if len(entries) != n + 1:
        raise TeacherAnswerError(
            f"the teacher returned {len(entries)} input log-probs for a {n}-token response "
            f"(expected the placeholder and {n})"
        )
    if entries[0][0] is not None:
        raise TeacherAnswerError(
            "the first input log-prob is not SGLang's placeholder (None): the answer is "
            "offset from the tokens it scored"
        )
    ids = [int(t) for _, t, _ in entries[1:]]
    if ids != sample.response_tokens:
        at = next(
            i for i, (a, b) in enumerate(zip(ids, sample.response_tokens, strict=True)) if a != b
        )
        raise TeacherAnswerError(
            f"the teacher scored other token ids than the student's (response position {at}: "
            f"{ids[at]} for {sample.response_tokens[at]})"
        )
    values = [lp for lp, _, _ in entries[1:]]
    bad = next((v for v in values if v is None or not math.isfinite(v) or v > _ABOVE_ZERO), "ok")
    if bad != "ok":
        raise TeacherAnswerError(f"the teacher returned a log-prob of {bad}, not a finite ≤ 0")
    return np.asarray(values, dtype=np.float32)


def top_entries(row: dict[int, float], k: int) -> dict[int, float]:
    """The k likeliest entries of a position (ties by token id)."""
    return dict(sorted(row.items(), key=lambda e: (-e[1], e[0]))[:k])


def likeliest(rows: list[dict[int, float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's k likeliest token ids and their log-probs ([R, k] each), from the
    teacher's top-k entries; TeacherAnswerError where a position has fewer than k."""
    short = next((j for j, row in enumerate(rows) if len(row) < k), None)
    if short is not None:
        raise TeacherAnswerError(
            f"the answer's input_top_logprobs has {len(rows[short])} entries at response "
            f"position {short}, fewer than train.distill.kd_top_k ({k})"
        )
    top = [list(top_entries(row, k).items()) for row in rows]
    ids = np.asarray([[i for i, _ in row] for row in top], dtype=np.int32).reshape(-1, k)
    log_probs = np.asarray([[v for _, v in row] for row in top], dtype=np.float32)
    return ids, log_probs.reshape(-1, k)
