"""The top-k KL between student and teacher at one response position.

Instead of the sampled token alone, the KL term sums over a set of tokens at each position:

    only_student    the student's k likeliest tokens
    only_teacher    the teacher's k likeliest tokens
    intersection    tokens in both top-k sets
    union           tokens in either

    kl_t = Σ_{i ∈ set} w_i · (log s_i − log t_i),   w_i = s_i / Σ_{j ∈ set} s_j

The weights are the student's probabilities renormalised over the set, so kl_t is the reverse
KL(student ‖ teacher) restricted to the set (with the set the whole vocabulary, the exact
reverse KL up to the teacher's normalisation). An empty intersection gives 0.

Each side's log-probs come from its engine's prompt scoring (`input_top_logprobs` for its own
top-k, `input_token_ids_logprobs` for the other side's tokens): `needs` says which of those a
strategy asks for, so no side scores tokens the set never uses.
"""

from __future__ import annotations

import math

STRATEGIES = ("only_student", "only_teacher", "intersection", "union")


def needs(strategy: str) -> tuple[bool, bool]:
    """(the student's log-probs at the teacher's top-k, the teacher's at the student's)."""
    return strategy in ("only_teacher", "union"), strategy in ("only_student", "union")


def token_set(strategy: str, student_top: list[int], teacher_top: list[int]) -> list[int]:
    s, t = list(dict.fromkeys(student_top)), list(dict.fromkeys(teacher_top))
    if strategy == "only_student":
        return s
    if strategy == "only_teacher":
        return t
    if strategy == "intersection":
        return [i for i in s if i in set(t)]
    if strategy == "union":
        return s + [i for i in t if i not in set(s)]
    raise ValueError(f"unknown top-k strategy {strategy!r}; choose one of {STRATEGIES}")


def position_kl(
    strategy: str,
    student: dict[int, float],
    teacher: dict[int, float],
    student_top: list[int],
    teacher_top: list[int],
) -> float:
    """kl_t over the strategy's set; `student` / `teacher`: token id → log-prob, for at least
    every id of the set (KeyError naming the side otherwise)."""
    ids = token_set(strategy, student_top, teacher_top)
    if not ids:
        return 0.0
    for side, values in (("student", student), ("teacher", teacher)):
        missing = [i for i in ids if i not in values]
        if missing:
            raise KeyError(f"the {side}'s log-probs lack token ids {missing[:5]} of the set")
    top = max(student[i] for i in ids)
    weights = [math.exp(student[i] - top) for i in ids]
    total = sum(weights)
    return sum(w / total * (student[i] - teacher[i]) for w, i in zip(weights, ids, strict=True))
