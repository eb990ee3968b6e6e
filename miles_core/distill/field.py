"""The teacher's log-prob of each response token: a declared per-token field, written by the
teacher scoring (not by the rollout engine), carried like any other through the async buffer,
its checkpoints and the train batch."""

from __future__ import annotations

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
