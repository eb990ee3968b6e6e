"""The OpenAI chat-completions shapes the session server accepts and returns (the subset agents
use: messages with tool calls and reasoning, tools, max tokens, sampling, seed)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_core.processes.http_limits import BadJson, parse_json
from miles_core.tito import Message


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        try:  # strictly, as bodies are: a 50k-deep string here must not reach json's recursion
            if not v.strip():
                raise BadJson("tool-call arguments are not JSON (empty)")
            parse_json(v, what="tool-call arguments")
        except BadJson as e:
            raise ValueError(str(e)) from None
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role != "assistant" and self.tool_calls:
            raise ValueError(f"a {self.role} message cannot carry tool_calls")
        if self.role in ("system", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r} is not supported")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""

    def plain(self) -> Message:
        out: Message = {"role": self.role, "content": self.text()}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    # torch's seed range (what the engine's sampling_seed accepts); agent evaluation episodes
    # use negative seeds (agents/rollout.py)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    n: int = 1
    stream: bool = False

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.n != 1:
            raise ValueError("n must be 1 (one completion per request)")
        if self.stream:
            raise ValueError("stream=true is not supported: a session returns whole turns")
        if self.messages[-1].role == "assistant":
            raise ValueError("the last message must be user, tool or system: nothing to answer")
        return self

    def plain_messages(self) -> list[Message]:
        return [m.plain() for m in self.messages]


def completion_response(
    session_id: str,
    node_id: int,
    model: str,
    reply: Message,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    weight_version: int,
    output_ids: list[int],
    cached_tokens: int = 0,
    broken_tool_call: bool = False,
) -> dict[str, Any]:
    if finish_reason == "stop" and reply.get("tool_calls"):
        finish_reason = "tool_calls"
    message = {"role": "assistant", "content": reply.get("content") or None}
    if reply.get("reasoning_content"):
        message["reasoning_content"] = reply["reasoning_content"]
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return {
        "id": f"chatcmpl-{session_id}-{node_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # the prompt's ids the engine found in its prefix cache
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
        # not OpenAI's: what the engine generated, for harnesses and tests that check tokens,
        # and whether the reply holds a tool call the family could not parse
        "miles": {
            "weight_version": str(weight_version),
            "output_ids": output_ids,
            "broken_tool_call": broken_tool_call,
        },
    }
