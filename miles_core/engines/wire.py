"""Request and response shapes of SGLang's native `/generate` API (the subset the runtime uses).

Field names follow `sglang/srt/managers/io_struct.py` (GenerateReqInput) and
`sglang/srt/sampling/sampling_params.py`, so the embedded engine and a real SGLang server answer
the same payloads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_core.token_fields import check_lengths, decode_meta

TOP_K_OFF = 1 << 30  # SGLang's "no top-k" value


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int = 128
    temperature: float = Field(1.0, ge=0, description="0 = greedy (as in SGLang)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 (or 1<<30) disables top-k")
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = True
    sampling_seed: int | None = None

    def effective_top_k(self) -> int:
        if self.temperature == 0:
            return 1
        return 0 if self.top_k <= 0 or self.top_k >= TOP_K_OFF else self.top_k

    def effective_temperature(self) -> float:
        """Greedy requests report log-probs of the untempered distribution."""
        return self.temperature or 1.0


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_ids: list[int]
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = True
    # declared token fields the response should carry in meta_info (token_fields.py), asked for
    # by each field's request flag
    return_fields: list[str] = Field(default_factory=list)
    rid: str | None = None
    # the LoRA adapter to generate with, by name (None: the base model), as SGLang's
    lora_path: str | None = None
    # SGLang's prompt scoring: log-probs of input_ids[k:] in meta_info.input_token_logprobs
    # (-1: none); entry 0 is a placeholder (prompt_logprobs.py)
    logprob_start_len: int = -1
    # ours: the temperature the input log-probs are computed at (logits / T), echoed in
    # meta_info; SGLang scores input positions at 1 whatever the sampling temperature
    input_logprob_temperature: float | None = Field(None, gt=0)
    # with scoring, per scored position: its `top_logprobs_num` likeliest tokens
    # (meta_info.input_top_logprobs) and the log-probs of the ids in `token_ids_logprob`
    # (meta_info.input_token_ids_logprobs), as SGLang's fields of those names
    top_logprobs_num: int = Field(0, ge=0)
    token_ids_logprob: list[int] | None = None
    routing_key: str | None = (
        None  # session affinity through the router (never sent as a body field)
    )


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | None = None
    length: int | None = None
    message: str | None = None  # why an abort happened (engine error, shutdown), as in SGLang


def version_number(weight_version: str) -> int:
    """Our policy versions are integers; SGLang starts a server at "default" (the weights it
    loaded, before any update): that is version 0."""
    if weight_version == "default":
        return 0
    try:
        return int(weight_version)
    except ValueError:
        raise ValueError(
            f"engine weight_version {weight_version!r} is neither an integer policy version "
            "nor SGLang's initial 'default'"
        ) from None


class MetaInfo(BaseModel):
    # extra keys are kept: declared per-token fields arrive under their wire keys
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str

    @property
    def version(self) -> int:
        return version_number(self.weight_version)

    # SGLang's layout: one [logprob, token_id, text] triple per output token.
    output_token_logprobs: list[tuple[float, int, str | None]] = Field(default_factory=list)
    # asked for by logprob_start_len k: one triple per input position from k on, the first a
    # placeholder whose log-prob is None (SGLang's layout); None when not asked
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    # the temperature those were computed at (ours; absent from SGLang, whose value is 1)
    input_logprob_temperature: float | None = None
    # per scored position (the first a placeholder, None): [logprob, token_id, text] of its
    # top_logprobs_num likeliest tokens, and of the token_ids_logprob ids
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None


class GenerateResponse(BaseModel):
    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo
    # declared per-token fields (miles_core/token_fields.py), decoded from meta_info by wire key;
    # never serialised (an engine sends them in meta_info)
    token_fields: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)
    # why the per-token fields were refused (a record that does not fit the tokens or the
    # model, e.g. routed experts from another model): the sample fails, not the request
    field_error: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _decode_token_fields(self) -> GenerateResponse:
        try:
            fields = decode_meta(self.meta_info.model_extra or {})
            fields = fields | self.token_fields  # given arrays win (joined calls)
            check_lengths(
                fields, self.meta_info.prompt_tokens + len(self.output_ids), len(self.output_ids)
            )
        except ValueError as e:
            self.token_fields, self.field_error = {}, str(e)
        else:
            self.token_fields = fields
        return self

    @property
    def output_log_probs(self) -> list[float]:
        return [lp for lp, _, _ in self.meta_info.output_token_logprobs]


class EngineRequestError(ValueError):
    """A request an engine cannot serve (bad ids, lengths): a client error (HTTP 4xx)."""


def validate_request(req: GenerateRequest, vocab_size: int, max_context: int) -> None:
    """Raises EngineRequestError naming what is wrong with `req` for a model of this size."""
    sp = req.sampling_params
    if not req.input_ids:
        raise EngineRequestError("input_ids is empty")
    bad = next((t for t in req.input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineRequestError(f"token id {bad} outside the vocabulary [0, {vocab_size})")
    if sp.max_new_tokens < 0:
        raise EngineRequestError(f"max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if len(req.input_ids) + sp.max_new_tokens > max_context:
        raise EngineRequestError(
            f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
            f"exceeds the context length {max_context}"
        )
    if req.logprob_start_len > len(req.input_ids):
        raise EngineRequestError(
            f"logprob_start_len {req.logprob_start_len} is past the input's "
            f"{len(req.input_ids)} tokens"
        )
    if req.logprob_start_len < -1:
        raise EngineRequestError(f"logprob_start_len must be >= -1, got {req.logprob_start_len}")
    if req.top_logprobs_num > vocab_size:
        raise EngineRequestError(
            f"top_logprobs_num {req.top_logprobs_num} exceeds the vocabulary ({vocab_size} tokens)"
        )
    bad = next((t for t in req.token_ids_logprob or [] if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineRequestError(
            f"token_ids_logprob: token id {bad} outside the vocabulary [0, {vocab_size})"
        )
    stop = next((t for t in sp.stop_token_ids or [] if not 0 <= t < vocab_size), None)
    if stop is not None:
        raise EngineRequestError(f"stop token id {stop} outside the vocabulary [0, {vocab_size})")
