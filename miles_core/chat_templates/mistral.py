"""`mistral`: Mistral-7B-Instruct v0.3's SentencePiece vocabulary (32,768; Llama-style SPM) and
instruct format, both from the `mistral-common` package: `[INST] … [/INST]`, `[TOOL_CALLS]`,
`[TOOL_RESULTS]`. The canonical render is mistral-common's own `encode_chat_completion`; new
messages are encoded one by one with its per-message encoders."""

from __future__ import annotations

import json

from miles_core.tito.family import Message, TitoFamily
from miles_core.tito.registry import FAMILIES


@FAMILIES.register("mistral")
class MistralFamily(TitoFamily):
    name = "mistral"
    limits = (
        "the system prompt is merged into the last user message, so it moves with every new "
        "user turn; a session keeps it where it was first rendered",
        "the tool list is placed just before the last user message, so it moves too",
        "reasoning_content is not rendered: this format has no reasoning tokens",
        "tool-call ids must be 9 letters or digits",
        "an assistant message holds text or tool calls, not both (text beside tool calls is "
        "dropped)",
    )
    expected_append_only = ("plain", "reasoning")
    renders_reasoning = False
    content_with_tool_calls = False
    tool_call_markup = ("[TOOL_CALLS]",)

    def __init__(self):
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.mistral = MistralTokenizer.v3()
        self.instruct = self.mistral.instruct_tokenizer
        self.spm = self.instruct.tokenizer
        self._stop = [self.spm.eos_id]

    @property
    def stop_ids(self) -> list[int]:
        return self._stop

    # ------------------------------------------------------------------ conversions
    def _message(self, m: Message):
        from mistral_common.protocol.instruct.messages import (
            AssistantMessage,
            SystemMessage,
            ToolMessage,
            UserMessage,
        )
        from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall

        role = m.get("role")
        if role == "system":
            return SystemMessage(content=m["content"])
        if role == "user":
            return UserMessage(content=m["content"])
        if role == "tool":
            return ToolMessage(content=m["content"], tool_call_id=m.get("tool_call_id"))
        if role == "assistant":
            calls = [
                ToolCall(
                    id=c.get("id"),
                    function=FunctionCall(
                        name=c["function"]["name"], arguments=c["function"]["arguments"]
                    ),
                )
                for c in m.get("tool_calls") or []
            ]
            content = None if calls else m.get("content") or None
            return AssistantMessage(content=content, tool_calls=calls or None)
        raise ValueError(f"unknown role {role!r}")

    def _tools(self, tools):
        from mistral_common.protocol.instruct.tool_calls import Function, Tool

        return [Tool(function=Function(**t["function"])) for t in tools or []] or None

    # ------------------------------------------------------------------ family
    def prompt(self, messages, tools=None) -> list[int]:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = ChatCompletionRequest(
            messages=[self._message(m) for m in messages], tools=self._tools(tools)
        )
        return list(self.mistral.encode_chat_completion(request).tokens)

    def append(self, messages, tools=None) -> list[int]:
        out: list[int] = []
        for m in messages:
            role = m.get("role")
            if role == "user":
                ids, _, _ = self.instruct.encode_user_message(
                    self._message(m), None, is_last=False, is_first=False
                )
            elif role == "tool":
                ids, _, _ = self.instruct.encode_tool_message(self._message(m), False)
            else:
                raise ValueError(f"mistral: cannot append a {role!r} message after a turn")
            out += ids
        return out

    def completion(self, message, tools=None) -> list[int]:
        return list(self.instruct.encode_assistant_message(self._message(message), False))

    def decode(self, ids) -> str:
        """Pieces, special tokens included (`▁` marks a space)."""
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        return self.spm.decode(list(ids), special_token_policy=SpecialTokenPolicy.KEEP)

    def _text(self, ids) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        return self.spm.decode(list(ids), special_token_policy=SpecialTokenPolicy.IGNORE)

    def parse(self, ids) -> Message:
        ids = [t for t in ids if t not in self._stop]
        calls_at = next((i for i, t in enumerate(ids) if t == self.instruct.TOOL_CALLS), None)
        content = self._text(ids[:calls_at]).strip() if calls_at != 0 else ""
        message: Message = {"role": "assistant", "content": content}
        if calls_at is not None:
            raw = json.loads(self._text(ids[calls_at + 1 :]).strip())
            message["tool_calls"] = [
                {
                    "id": c.get("id") or f"call{i:05d}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for i, c in enumerate(raw)
            ]
        return message
