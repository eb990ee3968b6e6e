"""`miles tito verify --family NAME`: renders seeded N-turn conversations (plain chat, tool calls
with a system prompt, reasoning) and checks, at every turn, that the session's ids (prompt +
completions + appended messages) equal a full render of the conversation so far, and that each
completion parses back to its message. Families declare the variants their template cannot
render append-only (`expected_append_only`); mismatches elsewhere fail the check, mismatches there
are reported with where the ids part."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field

from miles_core.tito.family import Message, TitoFamily

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
    matched: int = 0
    parsed: int = 0
    first_mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.expected or (self.matched == self.turns and self.parsed == self.turns)


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


def _where(family: TitoFamily, held: list[int], full: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(held, full, strict=False)) if a != b), None)
    i = min(len(held), len(full)) if i is None else i
    return (
        f"ids part at position {i} (session {len(held)} ids, full render {len(full)}): "
        f"session …{family.decode(held[max(0, i - 8) : i + 12])!r} vs "
        f"render …{family.decode(full[max(0, i - 8) : i + 12])!r}"
    )


def verify_variant(
    family: TitoFamily, variant: str, conversations: int, turns: int, seed: int
) -> VariantReport:
    rng = random.Random(f"{family.name}-{variant}-{seed}")
    report = VariantReport(variant, variant in family.expected_append_only)
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
            held = held + completion
            end = turn_at[k + 1] if k + 1 < len(turn_at) else len(messages)
            if end == at + 1:  # the conversation ends with this turn
                report.turns += 1
                report.matched += 1  # nothing appended: the ids are the engine's own
                continue
            held = held + family.append(messages[at + 1 : end], tools)
            full = family.prompt(messages[:end], tools)
            report.turns += 1
            if held == full:
                report.matched += 1
            elif len(report.first_mismatches) < 3:
                report.first_mismatches.append(f"turn {k + 1}: {_where(family, held, full)}")
    return report


def verify(family: TitoFamily, conversations: int = 20, turns: int = 8, seed: int = 0):
    return [verify_variant(family, v, conversations, turns, seed) for v in VARIANTS]
