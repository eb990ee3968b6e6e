"""The teacher's log-prob of each response token: a declared per-token field, written by the
teacher scoring (not by the rollout engine), carried like any other through the async buffer,
its checkpoints and the train batch."""

from __future__ import annotations

import re

from miles_core.token_fields import FIELDS, TokenField

PATH = "miles_core.distill.field:TEACHER_LOG_PROBS"

TEACHER_LOG_PROBS = TokenField(
    name="teacher_log_probs",
    dtype="float32",
    fill=0.0,
    pad=0.0,
    description="the teacher's log-prob of each response token, at the student's temperature",
)
FIELDS.register(TEACHER_LOG_PROBS.name, TEACHER_LOG_PROBS)

TOP_K_PATH = "miles_core.distill.field:TOP_K_KL"

TOP_K_KL = TokenField(
    name="teacher_topk_kl",
    dtype="float32",
    fill=0.0,
    pad=0.0,
    description="train.distill.top_k: the KL(student ‖ teacher) of each response position over "
    "its top-k token set (distill/top_k.py)",
)
FIELDS.register(TOP_K_KL.name, TOP_K_KL)

# train.distill.kd_top_k: the teacher's k likeliest tokens at each response position and their
# log-probs, for the dense term of the `distill` loss. The per-token shape is k, so each k is a
# field of its own: `TEACHER_TOP<k>_IDS` / `TEACHER_TOP<k>_LOG_PROBS`, built on first import.
_TOP_K_NAME = re.compile(r"TEACHER_TOP([1-9][0-9]{0,5})_(IDS|LOG_PROBS)")


def kd_paths(k: int) -> tuple[str, str]:
    """The import paths of the teacher's top-k token ids and their log-probs (k per token)."""
    return f"{__name__}:TEACHER_TOP{k}_IDS", f"{__name__}:TEACHER_TOP{k}_LOG_PROBS"


def kd_names(k: int) -> tuple[str, str]:
    return f"teacher_top{k}_ids", f"teacher_top{k}_log_probs"


def __getattr__(name: str) -> TokenField:
    match = _TOP_K_NAME.fullmatch(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    k, kind = int(match[1]), match[2]
    ids, log_probs = kd_names(k)
    if kind == "IDS":
        return TokenField(
            name=ids,
            dtype="int32",
            shape=(k,),
            description=f"the teacher's {k} likeliest token ids at each response position",
        )
    return TokenField(
        name=log_probs,
        dtype="float32",
        shape=(k,),
        description=f"the teacher's log-probs of its {k} likeliest tokens at each position",
    )
