"""The weight version each response token was generated with: a declared per-token field the
engines fill when asked (`return_token_versions`) and with every response in true on-policy
mode (a router in front of engine servers passes no request flag of ours), so a sample that
spans pushes (a request retracted and resumed, or continued after a pause-abort) says which of
its tokens each policy version produced. True on-policy adds it to every run (`rollout.token_fields`): the trainer
recomputes a stale token under the weights that generated it (`behaviour.py`)."""

from __future__ import annotations

from miles_core.token_fields import FIELDS, TokenField

PATH = "miles_core.true_on_policy.token_versions:TOKEN_VERSIONS"
UNKNOWN = -1  # a token no engine generated (a session's observation tokens), or padding

TOKEN_VERSIONS = TokenField(
    name="token_versions",
    dtype="int64",
    wire_key="output_token_versions",
    request_flag="return_token_versions",
    fill=UNKNOWN,
    pad=UNKNOWN,
    description="the weight version of the decode step that generated each response token",
)
FIELDS.register(TOKEN_VERSIONS.name, TOKEN_VERSIONS)


def reported(return_fields: list[str], true_on_policy: bool) -> bool:
    """Whether an engine puts the field in a response: asked for, or in true on-policy mode."""
    return true_on_policy or TOKEN_VERSIONS.name in return_fields
