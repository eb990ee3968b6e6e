"""ChatML families driven by a Jinja chat template (Qwen3-style: tools in the system turn,
`<think>` reasoning, `<tool_call>` JSON, tool results as `<tool_response>` in a user turn).

New messages are rendered under a fixed dummy history and cut after it, so only the appended
messages are tokenized; the tokens the template puts between an assistant's stop token and the
next message (ChatML's newline after `<|im_end|>`), which the engine never generates, are the
`junction` found from the same dummy render.
"""

from __future__ import annotations

import json
import re

from miles_core.tito.family import Message, NotAppendOnly, TitoFamily

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def chat_template(keep_history_reasoning: bool) -> str:
    """The Jinja template. With `keep_history_reasoning` false (Qwen3's own behaviour) an
    assistant's `<think>` block is rendered only after the last user message."""
    keep = "true" if keep_history_reasoning else "false"
    return (
        "{%- set keep = " + keep + " -%}"
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if tools -%}"
        "{{- '<|im_start|>system\\n' -}}"
        "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}"
        "{%- endif -%}"
        "{{- " + json.dumps(_TOOLS_HEADER) + " -}}"
        "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
        "{{- " + json.dumps(_TOOLS_FOOTER) + " + '<|im_end|>\\n' -}}"
        "{%- elif messages and messages[0].role == 'system' -%}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' and loop.first -%}"
        "{%- elif m.role == 'user' or m.role == 'system' -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- elif m.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if m.reasoning_content and (keep or loop.index0 > ns.last_user) -%}"
        "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{{- m.content or '' -}}"
        "{%- for tc in (m.tool_calls or []) -%}"
        "{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}"
        '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' '
        "+ tc.function.arguments + '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif m.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
        "{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
        "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


_DUMMY: list[Message] = [
    {"role": "user", "content": "."},
    {"role": "assistant", "content": "."},
]
_THINK = re.compile(r"^<think>\n(.*?)\n</think>\n\n", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


class ChatMLFamily(TitoFamily):
    """A family whose tokenizer is a HF tokenizer carrying one of the templates above."""

    tool_call_markup = ("<tool_call>",)

    def __init__(self, tokenizer, keep_history_reasoning: bool):
        self.tokenizer = tokenizer
        self.tokenizer.chat_template = chat_template(keep_history_reasoning)
        self._stop = [self.tokenizer.convert_tokens_to_ids(IM_END)]
        self._fixed: dict[tuple[str, str], list[int]] = {}  # dummy renders, per tools

    def _dummy(self, which: str, tools) -> list[int]:
        """The renders that do not depend on the new messages (cached per tools)."""
        key = (which, json.dumps(tools, sort_keys=True))
        if key not in self._fixed:
            if which == "base":
                self._fixed[key] = self._render(_DUMMY, tools)
            else:  # "head": the dummy user turn + generation prompt
                self._fixed[key] = self._render(_DUMMY[:1], tools, generation_prompt=True)
        return self._fixed[key]

    @property
    def stop_ids(self) -> list[int]:
        return self._stop

    def _render(self, messages, tools=None, generation_prompt=False) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def prompt(self, messages, tools=None) -> list[int]:
        return self._render(messages, tools, generation_prompt=True)

    def _junction(self, base: list[int]) -> list[int]:
        """The tokens after the dummy assistant's stop token: rendered, never generated."""
        last = max(i for i, t in enumerate(base) if t in self._stop)
        return base[last + 1 :]

    def append(self, messages, tools=None) -> list[int]:
        if any(m.get("role") == "assistant" for m in messages):
            raise ValueError("append takes the messages after an assistant turn, not another one")
        base = self._dummy("base", tools)
        full = self._render(_DUMMY + list(messages), tools, generation_prompt=True)
        if full[: len(base)] != base:
            raise NotAppendOnly(f"{self.name}: rendering new messages changes the history")
        return self._junction(base) + full[len(base) :]

    def completion(self, message, tools=None) -> list[int]:
        head = self._dummy("head", tools)
        full = self._render(_DUMMY[:1] + [message], tools)
        if full[: len(head)] != head:
            raise NotAppendOnly(f"{self.name}: an assistant turn changes the history")
        junction = self._junction(self._dummy("base", tools))
        body = full[len(head) :]
        return body[: len(body) - len(junction)] if junction else body

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def parse(self, ids) -> Message:
        text = self.decode([t for t in ids if t not in self._stop])
        message: Message = {"role": "assistant", "content": text}
        think = _THINK.match(text)
        if think:
            message["reasoning_content"] = think.group(1)
            text = text[think.end() :]
        calls = []
        for i, m in enumerate(_TOOL_CALL.finditer(text)):
            call = json.loads(m.group(1))  # JSONDecodeError: the caller marks the turn
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call.get("arguments", {})),
                    },
                }
            )
        if calls:
            message["tool_calls"] = calls
            text = text[: _TOOL_CALL.search(text).start()].rstrip("\n")  # type: ignore[union-attr]
        message["content"] = text
        return message
