"""A TITO family defined outside miles_core, as a user would write one: loaded by import path
(`agent.family: tests.plugins.family:HeadersFamily`, `miles tito verify --family ...`), nothing
registered inside the package.

Its chat format is not ChatML: markdown-style `### Role` headers, tool calls as `[[call]]` JSON
`[[/call]]` (markup of its own: `tool_call_markup`), tool results headed by their call id,
`<|endoftext|>` (not `<|im_end|>`) ending an assistant turn, over our character-level tokenizer. The renders are written in Python; `CHAT_TEMPLATE` is the same format as a Jinja chat
template, for the model directory of a model that speaks it (what `--model DIR` and the session
server's start-up check compare with).
"""

from __future__ import annotations

import json
import re

from miles_core.models.tokenizer import EOS, build_tokenizer
from miles_core.tito import Message, TitoFamily

GENERATION_PROMPT = "### Assistant\n"
AFTER_TURN = "\n\n"  # what the template puts after an assistant's stop token (never generated)

CHAT_TEMPLATE = (
    "{%- if tools -%}{{- '### Tools\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}{{- '\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '### Assistant\\n' -}}"
    "{%- if m.reasoning_content -%}{{- '<think>' + m.reasoning_content + '</think>' -}}"
    "{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for tc in (m.tool_calls or []) -%}"
    '{{- \'[[call]]{"name": "\' + tc.function.name + \'", "arguments": \' '
    "+ tc.function.arguments + '}[[/call]]' -}}"
    "{%- endfor -%}"
    "{{- '" + EOS + "\\n\\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '### Tool ' + m.tool_call_id + '\\n' + m.content + '\\n\\n' -}}"
    "{%- else -%}{{- '### ' + (m.role | capitalize) + '\\n' + m.content + '\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Assistant\\n' -}}{%- endif -%}"
)

_THINK = re.compile(r"^<think>(.*?)</think>", re.S)
_CALL = re.compile(r"\[\[call\]\](.*?)\[\[/call\]\]", re.S)


class HeadersFamily(TitoFamily):
    name = "headers"
    limits = ("characters outside printable ASCII become <|unk|>",)
    ascii_only = True
    tool_call_markup = ("[[call]]",)

    def __init__(self):
        self.tokenizer = build_tokenizer()
        self._stop = [self.tokenizer.convert_tokens_to_ids(EOS)]

    @property
    def stop_ids(self) -> list[int]:
        return self._stop

    def chat_template(self) -> str:
        return CHAT_TEMPLATE

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _body(m: Message) -> str:
        """An assistant message as the model writes it, without the stop token."""
        text = f"<think>{m['reasoning_content']}</think>" if m.get("reasoning_content") else ""
        text += m.get("content") or ""
        for c in m.get("tool_calls") or []:
            f = c["function"]
            text += f'[[call]]{{"name": "{f["name"]}", "arguments": {f["arguments"]}}}[[/call]]'
        return text

    def _text(self, m: Message) -> str:
        role = m.get("role")
        if role == "assistant":
            return GENERATION_PROMPT + self._body(m) + EOS + AFTER_TURN
        if role == "tool":
            return f"### Tool {m['tool_call_id']}\n{m['content']}\n\n"
        if role in ("system", "user"):
            return f"### {role.capitalize()}\n{m['content']}\n\n"
        raise ValueError(f"headers: unknown role {role!r}")

    @staticmethod
    def _tools(tools: list[dict] | None) -> str:
        if not tools:
            return ""
        return (
            "### Tools\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + "\n"
        )

    def prompt(self, messages, tools=None) -> list[int]:
        text = self._tools(tools) + "".join(self._text(m) for m in messages)
        return self._encode(text + GENERATION_PROMPT)

    def append(self, messages, tools=None) -> list[int]:
        if any(m.get("role") == "assistant" for m in messages):
            raise ValueError("append takes the messages after an assistant turn, not another one")
        text = AFTER_TURN + "".join(self._text(m) for m in messages)
        return self._encode(text + GENERATION_PROMPT)

    def completion(self, message, tools=None) -> list[int]:
        return self._encode(self._body(message)) + self._stop

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def parse(self, ids) -> Message:
        text = self.decode([t for t in ids if t not in self._stop])
        message: Message = {"role": "assistant"}
        think = _THINK.match(text)
        if think:
            message["reasoning_content"] = think.group(1)
            text = text[think.end() :]
        calls = []
        for i, m in enumerate(_CALL.finditer(text)):
            call = json.loads(m.group(1))
            arguments = json.dumps(call.get("arguments", {}))
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": arguments},
                }
            )
        if calls:
            message["tool_calls"] = calls
            text = text[: _CALL.search(text).start()]  # type: ignore[union-attr]
        message["content"] = text
        return message


class BrokenFamily(HeadersFamily):
    """A family whose constructor fails, as one whose tokenizer file is missing would."""

    def __init__(self):
        raise RuntimeError("no vocabulary file at /nowhere")


def save_model_dir(directory, max_positions: int | None = None):
    """The seeded tiny model saved with this family's chat template: a model that speaks it."""
    from miles_core.models import build_model, save_hf_dir

    model, tok = build_model("tiny", seed=0)
    if max_positions is not None:
        model.config.max_position_embeddings = max_positions
    tok.chat_template = CHAT_TEMPLATE
    return save_hf_dir(model, tok, directory)
