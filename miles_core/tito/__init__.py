"""Token-in-token-out tokenization per model family (see family.py). Adding a family = one file
with a `TitoFamily` subclass + one line in FAMILIES; `miles tito verify --family NAME` checks it."""

from __future__ import annotations

from collections.abc import Callable

from miles_core.tito.family import Message, NotAppendOnly, TitoFamily


def _tiny() -> TitoFamily:
    from miles_core.tito.tiny import TinyFamily

    return TinyFamily()


def _qwen3() -> TitoFamily:
    from miles_core.tito.qwen3 import Qwen3Family

    return Qwen3Family()


def _mistral() -> TitoFamily:
    from miles_core.tito.mistral import MistralFamily

    return MistralFamily()


FAMILIES: dict[str, Callable[[], TitoFamily]] = {
    "tiny": _tiny,
    "qwen3": _qwen3,
    "mistral": _mistral,
}


def get_family(name: str) -> TitoFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown TITO family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]()


__all__ = ["FAMILIES", "Message", "NotAppendOnly", "TitoFamily", "get_family"]
