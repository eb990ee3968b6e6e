"""Token-in-token-out tokenization per model family (see family.py).

A family is a `TitoFamily` subclass in any module; name it by import path
(`agent.family: package.module:Class`, `miles tito verify --family package.module:Class`) or
register it under a short name with `@FAMILIES.register(name)` (registry.py), as the built-ins in
`miles_core/chat_templates/` do. `miles tito verify --family NAME [--model DIR]` checks it."""

from __future__ import annotations

from miles_core.tito.family import Message, NotAppendOnly, TitoFamily
from miles_core.tito.registry import FAMILIES, build_family

__all__ = ["FAMILIES", "Message", "NotAppendOnly", "TitoFamily", "build_family"]
