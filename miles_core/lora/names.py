"""How adapters and their tensors are named.

A peft checkpoint (`adapter_model.safetensors`) keys a module's pair as
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, `<module>` the HF module name
(`model.layers.0.self_attn.q_proj`). A push carries several adapters, so its tensors are named
`lora.<adapter>.<module>.lora_A.weight`: every transport moves them like any named tensor, and
the engine routes them to the adapter they name.

An engine that cannot replace an adapter in place serves each push of adapter `<name>` as
`<name>@v<version>` (versions.py): `SERVED_NAME` is what an engine may call an adapter."""

from __future__ import annotations

import re

from miles_core.config.lora import ADAPTER_NAME

PEFT_PREFIX = "base_model.model."
WIRE_PREFIX = "lora."
PARTS = ("lora_A", "lora_B")
VERSION_MARK = "@v"
SERVED_NAME = re.compile(rf"({ADAPTER_NAME.pattern})(?:{VERSION_MARK}\d+)?")


def version_name(adapter: str, version: int) -> str:
    return f"{adapter}{VERSION_MARK}{version}"


def adapter_of(served: str) -> str:
    """The adapter a served name is a version of (a name without a version: itself)."""
    match = SERVED_NAME.fullmatch(served)
    return match.group(1) if match else served


def peft_key(module: str, part: str) -> str:
    return f"{PEFT_PREFIX}{module}.{part}.weight"


def wire_name(adapter: str, module: str, part: str) -> str:
    return f"{WIRE_PREFIX}{adapter}.{module}.{part}.weight"


def is_wire_name(name: str) -> bool:
    return name.startswith(WIRE_PREFIX)


def split_key(key: str) -> tuple[str, str]:
    """(module, part) of `<module>.lora_A.weight` (a peft key without its prefix, or a wire name
    without `lora.<adapter>.`)."""
    if key.endswith(".weight"):
        key = key[: -len(".weight")]
    module, _, part = key.rpartition(".")
    if part not in PARTS or not module:
        raise ValueError(f"{key!r} is not an adapter tensor (<module>.lora_A/lora_B.weight)")
    return module, part


def split_peft_key(key: str) -> tuple[str, str]:
    """(module, part) of a peft checkpoint key; peft's adapter-name segment (`.default`) is
    accepted and dropped, as peft itself does on save."""
    if not key.startswith(PEFT_PREFIX):
        raise ValueError(f"{key!r} is not a peft adapter key ({PEFT_PREFIX}...)")
    rest = key[len(PEFT_PREFIX) :]
    head, _, last = rest.removesuffix(".weight").rpartition(".")
    if last not in PARTS and head.rpartition(".")[2] in PARTS:  # `...lora_A.default.weight`
        rest = head
    return split_key(rest)


def split_wire_name(name: str) -> tuple[str, str, str]:
    """(adapter, module, part) of a wire name."""
    if not is_wire_name(name):
        raise ValueError(f"{name!r} is not an adapter tensor name ({WIRE_PREFIX}<adapter>...)")
    adapter, _, rest = name[len(WIRE_PREFIX) :].partition(".")
    module, part = split_key(rest)
    return adapter, module, part
