"""`miles tito verify --family NAME [--model DIR]`: renders seeded N-turn conversations (plain
chat, tool calls with a system prompt, reasoning) and checks, at every turn, that the session's ids
(prompt + completions + appended messages) equal a full render of the conversation so far, and
that each completion parses back to its message. The last turn is compared too: the conversation
is continued by a closing user message, so its completion is checked as a later render holds it.

Given a model directory that ships a chat template, every turn is also compared with that
template's render (the ids a user rendering with the model's own tokenizer would get), so a family
is checked against the model, not only against itself. Families declare the variants their
template cannot render append-only (`expected_append_only`); mismatches elsewhere fail the check,
mismatches there are reported with where the ids part."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from miles_core.tito.check import template_ids
from miles_core.tito.family import Message, TitoFamily

Template = Callable[[list[Message], list[dict] | None], list[int]]

VARIANTS = ("plain", "tools", "reasoning")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the workspace",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["path", "text"],
            },
        },
    },
]
# after a conversation's last assistant turn: its completion is compared as the next render holds it
CLOSING: Message = {"role": "user", "content": "thanks"}
_WORDS = "list the files count lines fix the failing test grep for TODO print hello".split()
_UNICODE = ["naïve café", "数据 文件", "emoji 🚀 ok", "tabs\tand\nnewlines", "code: x = [1, 2]"]


def _text(rng: random.Random, ascii_only: bool) -> str:
    words = rng.sample(_WORDS, rng.randint(2, 6))
    if not ascii_only and rng.random() < 0.4:
        words.append(rng.choice(_UNICODE))
    return " ".join(words)


def _call_id(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=9))


def conversation(
    variant: str, turns: int, rng: random.Random, ascii_only: bool, text_with_calls: bool = True
) -> tuple[list[Message], list[dict] | None]:
    """A conversation of `turns` assistant messages (the last one ends it)."""
    tools = TOOLS if variant == "tools" else None
    messages: list[Message] = []
    if variant == "tools":
        messages.append({"role": "system", "content": "You are a terminal agent. Be brief."})
    messages.append({"role": "user", "content": _text(rng, ascii_only)})
    for t in range(turns):
        if variant == "tools" and t < turns - 1 and rng.random() < 0.7:
            calls = []
            for _ in range(rng.randint(1, 2)):
                name = rng.choice(["run", "write_file"])
                args = (
                    {"cmd": rng.choice(["ls -la", "wc -l a.txt", "grep -n TODO *.py"])}
                    if name == "run"
                    else {"path": "notes.txt", "text": _text(rng, ascii_only)}
                )
                calls.append(
                    {
                        "id": _call_id(rng),
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            content = _text(rng, ascii_only) if text_with_calls and rng.random() < 0.3 else ""
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            for c in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": c["id"], "content": _text(rng, ascii_only)}
                )
            continue
        message: Message = {"role": "assistant", "content": _text(rng, ascii_only)}
        if variant == "reasoning":
            message["reasoning_content"] = _text(rng, ascii_only)
        messages.append(message)
        if t < turns - 1:
            messages.append({"role": "user", "content": _text(rng, ascii_only)})
    return messages, tools


@dataclass
class VariantReport:
    variant: str
    expected: bool  # the family's template should be append-only here
    turns: int = 0
    matched: int = 0  # turns whose session ids equal the family's full render
    parsed: int = 0
    first_mismatches: list[str] = field(default_factory=list)
    template_matched: int | None = None  # turns equal to the model template's render (if any)
    template_mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if not self.expected:
            return True
        template_ok = self.template_matched is None or self.template_matched == self.turns
        return self.matched == self.turns and self.parsed == self.turns and template_ok


def model_template(model_dir: str | Path) -> Template | None:
    """The chat-template render of a model directory's tokenizer (tokenizer_config.json or
    chat_template.jinja), ending in the generation prompt; None if it ships no template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        return None
    return lambda messages, tools: template_ids(tokenizer, messages, tools)


def _same(parsed: Message, original: Message, family: TitoFamily) -> bool:
    keep = getattr(family, "renders_reasoning", True)
    if (parsed.get("content") or "") != (original.get("content") or ""):
        return False
    if keep and (parsed.get("reasoning_content") or "") != (
        original.get("reasoning_content") or ""
    ):
        return False
    want = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in original.get("tool_calls") or []
    ]
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in parsed.get("tool_calls") or []
    ]
    return want == got


def _where(family: TitoFamily, held: list[int], full: list[int], what: str = "render") -> str:
    i = next((k for k, (a, b) in enumerate(zip(held, full, strict=False)) if a != b), None)
    i = min(len(held), len(full)) if i is None else i
    return (
        f"ids part at position {i} (session {len(held)} ids, {what} {len(full)}): "
        f"session …{family.decode(held[max(0, i - 8) : i + 12])!r} vs "
        f"{what} …{family.decode(full[max(0, i - 8) : i + 12])!r}"
    )


def verify_variant(
    family: TitoFamily,
    variant: str,
    conversations: int,
    turns: int,
    seed: int,
    template: Template | None = None,
) -> VariantReport:
    rng = random.Random(f"{family.name}-{variant}-{seed}")
    report = VariantReport(variant, variant in family.expected_append_only)
    if template is not None:
        report.template_matched = 0
    ascii_only = getattr(family, "ascii_only", False)
    for _ in range(conversations):
        messages, tools = conversation(
            variant, turns, rng, ascii_only, family.content_with_tool_calls
        )
        turn_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        held = family.prompt(messages[: turn_at[0]], tools)
        for k, at in enumerate(turn_at):
            completion = family.completion(messages[at], tools)
            report.parsed += _same(family.parse(completion), messages[at], family)
            end = turn_at[k + 1] if k + 1 < len(turn_at) else len(messages)
            added = messages[at + 1 : end] or [CLOSING]  # the last turn: a closing user message
            so_far = messages[: at + 1] + added
            held = held + completion + family.append(added, tools)
            report.turns += 1
            full = family.prompt(so_far, tools)
            if held == full:
                report.matched += 1
            elif len(report.first_mismatches) < 3:
                report.first_mismatches.append(f"turn {k + 1}: {_where(family, held, full)}")
            if template is not None:
                _compare_template(report, family, template, so_far, tools, held, k)
    return report


def _compare_template(report, family, template, messages, tools, held, k) -> None:
    try:
        rendered = template(messages, tools)
    except Exception as e:  # noqa: BLE001  (a template refusing the messages: they differ)
        where = f"the model template cannot render them: {e}"
    else:
        if rendered == held:
            report.template_matched += 1
            return
        where = _where(family, held, rendered, "template")
    if len(report.template_mismatches) < 3:
        report.template_mismatches.append(f"turn {k + 1}: {where}")


def verify(
    family: TitoFamily,
    conversations: int = 20,
    turns: int = 8,
    seed: int = 0,
    template: Template | None = None,
) -> list[VariantReport]:
    return [verify_variant(family, v, conversations, turns, seed, template) for v in VARIANTS]
