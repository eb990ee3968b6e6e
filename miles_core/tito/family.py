"""A TITO family: how one model family turns chat messages into token ids, so that a session can
hold the exact ids the engine saw and produced, and add only what each new turn appends.

A session's ids are built as

    prompt(first messages, tools)              the opening render, ending in the generation prompt
    + completion ids                           exactly what the engine generated (stop token included)
    + append(messages added since, tools)      tokens for the new messages only, then the next
                                               generation prompt
    + completion ids + append(...) + ...

`append` never re-tokenizes anything already held. Where a family's canonical template renders
history differently from how it was generated (e.g. Qwen3 drops the reasoning of earlier turns),
the session's ids and a full re-render differ; each family lists such places in `limits`, and
`miles tito verify` reports them.

A family is a subclass in any module, named by import path (`agent.family: pkg.mod:Class`) or
registered by name (registry.py); nothing in miles_core changes for a new one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

Message = dict[str, Any]  # OpenAI chat message: role, content, reasoning_content, tool_calls, ...


class NotAppendOnly(ValueError):
    """A render of more messages does not extend the render of fewer: the ids cannot be merged."""


class TitoFamily(ABC):
    name: str
    limits: tuple[str, ...] = ()  # places where the canonical template is not append-only
    # conversation kinds of `miles tito verify` whose full renders must equal the session's ids
    expected_append_only: tuple[str, ...] = ("plain", "tools", "reasoning")
    renders_reasoning = True  # reasoning_content survives completion → parse
    ascii_only = False  # the vocabulary covers only printable ASCII
    content_with_tool_calls = True  # an assistant message may hold text and tool calls
    # the text that opens a tool call in this family's format (as `decode` shows it): a reply
    # whose text still holds one after parsing is a call that did not parse
    tool_call_markup: tuple[str, ...] = ()

    @property
    @abstractmethod
    def stop_ids(self) -> list[int]:
        """Token ids that end an assistant turn (the engine's stop tokens)."""

    @abstractmethod
    def prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The canonical render of a conversation, ending in the assistant generation prompt."""

    @abstractmethod
    def append(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Ids to add after a held assistant completion (which ends in a stop token) for the new
        non-assistant `messages`, ending in the generation prompt."""

    @abstractmethod
    def completion(self, message: Message, tools: list[dict] | None = None) -> list[int]:
        """The ids a model emits for an assistant `message`, stop token included (what the
        engine would have generated for it)."""

    @abstractmethod
    def parse(self, ids: list[int]) -> Message:
        """An assistant message (content, reasoning_content, tool_calls) from completion ids."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included (for reports)."""

    def chat_template(self) -> str | None:
        """The Jinja chat template a model folder ships for this family (what `miles model
        init` writes, and what the session server's start-up check renders against): by
        default the template of the family's own Hugging Face tokenizer (`self.tokenizer`),
        if it has one."""
        return getattr(getattr(self, "tokenizer", None), "chat_template", None) or None

    def broken_tool_call(self, reply: Message) -> bool:
        """Whether `reply` (an assistant message as `parse_exact` made it) holds an attempt at a
        tool call that did not parse: this family's `tool_call_markup` left in its text. The
        session server reports it with each reply (`miles.broken_tool_call`); the sandbox agent
        counts it in `bad_calls`. Override for a format where that is not enough."""
        text = reply.get("content") or ""
        return any(m in text for m in self.tool_call_markup)

    def parse_exact(self, ids: list[int], tools: list[dict] | None = None) -> tuple[Message, str]:
        """The assistant message for completion `ids` that renders back to exactly these ids
        (a cut-off reply: plus the stop id a render closes it with), and how it was found:

        - "parsed": the structured message (content, reasoning, tool calls) round-trips;
        - "text": it does not (e.g. text after a tool call, a misspelt key: `parse` would drop
          or repair something), but the reply as plain text does — so a harness that echoes the
          message sends back exactly what the engine generated, and no tool call is invented;
        - "inexact": neither round-trips (the structured message if it parses, else the text).
        """
        closed = list(ids)
        if not closed or closed[-1] not in self.stop_ids:
            closed += self.stop_ids[:1]
        body = [t for t in ids if t not in self.stop_ids]
        text: Message = {"role": "assistant", "content": self.decode(body)}
        try:
            parsed: Message | None = self.parse(ids)
        except Exception:  # noqa: BLE001  (model output that is not a valid message)
            parsed = None
        for message, how in ((parsed, "parsed"), (text, "text")):
            if message is not None and self._renders_as(message, tools, closed):
                return message, how
        return parsed or text, "inexact"

    def _renders_as(self, message: Message, tools: list[dict] | None, ids: list[int]) -> bool:
        try:
            return self.completion(message, tools) == ids
        except Exception:  # noqa: BLE001  (a renderer refusing the message: not exact)
            return False
