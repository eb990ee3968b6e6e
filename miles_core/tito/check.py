"""Does a TITO family tokenize like a model? The family's render of a probe conversation must
give the same ids as the model tokenizer's own chat template: else the engine reads ids from
another vocabulary or format, and a session answers 200 with garbage."""

from __future__ import annotations

from miles_core.tito.family import Message, TitoFamily
from miles_core.tito.registry import build_family

PROBE: list[Message] = [{"role": "user", "content": "list the files"}]


def template_ids(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
    """The ids of `tokenizer`'s chat template for `messages`, ending in the generation prompt."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


def check_family_matches(
    family: TitoFamily | str,
    tokenizer,
    what: str = "agent.family",
    model: str = "the model",
    label: str | None = None,
) -> None:
    """ValueError unless `family` (an instance or a name / import path) renders the probe
    exactly as `tokenizer`'s chat template does. `what` / `label`: the setting and the value it
    was given, for the message."""
    name = label or (family if isinstance(family, str) else family.name)
    fam = build_family(family) if isinstance(family, str) else family
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{what} {name!r}: {model}'s tokenizer ships no chat template to check")
    ours = fam.prompt(PROBE)
    theirs = template_ids(tokenizer, PROBE)
    if ours != theirs:
        raise ValueError(
            f"{what} {name!r} does not tokenize like {model}: {ours[:12]}… against the "
            f"model tokenizer's {theirs[:12]}…; choose the family of the model's tokenizer"
        )
