"""Token-in-token-out tokenization per model family (see family.py).

A family is a `TitoFamily` subclass in any module; name it by import path
(`agent.family: package.module:Class`, `miles tito verify --family package.module:Class`) or
register it under a short name with `register_family` (registry.py), as the built-ins below do.
`miles tito verify --family NAME [--model DIR]` checks it."""

from __future__ import annotations

from miles_core.tito import mistral, qwen3, tiny  # noqa: F401  (built-ins register themselves)
from miles_core.tito.family import Message, NotAppendOnly, TitoFamily
from miles_core.tito.registry import (
    describe_choices,
    family_names,
    get_family,
    register_family,
    resolve_family,
)

__all__ = [
    "Message",
    "NotAppendOnly",
    "TitoFamily",
    "describe_choices",
    "family_names",
    "get_family",
    "register_family",
    "resolve_family",
]
