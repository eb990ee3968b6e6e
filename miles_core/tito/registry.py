"""The TITO family registry: a family is named by a registered name (`tiny`, `qwen3`, `mistral`:
each built-in is a module of `miles_core/chat_templates/` registering itself with
`@FAMILIES.register(name)`) or by an import path `package.module:obj`, where `obj` is a
`TitoFamily` subclass, a zero-argument factory returning one, or an instance. A new family is a
file anywhere on the path; nothing in miles_core changes."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from miles_core.plugins import Registry, raised_at
from miles_core.tito.family import TitoFamily

Factory = Callable[[], TitoFamily]


def _as_factory(obj: object, name: str) -> Factory:
    """An imported object as a family factory: an instance, a concrete subclass, or a
    zero-argument function (whose result is checked when it is built)."""
    if isinstance(obj, TitoFamily):
        return lambda: obj
    if inspect.isclass(obj):
        if not issubclass(obj, TitoFamily) or inspect.isabstract(obj):
            raise ValueError(
                f"TITO family {name!r}: {obj.__qualname__} is not a concrete TitoFamily subclass"
            )
        return obj
    if callable(obj):
        return _checked(name, obj)
    raise ValueError(f"TITO family {name!r} is neither a TitoFamily class nor a factory")


FAMILIES: Registry[Factory] = Registry(
    "TITO family",
    "agent.family",
    package="miles_core.chat_templates",
    example="package.module:Class",
    load=_as_factory,
)
"""`FAMILIES.get(name)` is the family's factory (the family itself may load a large tokenizer:
config validation asks for the factory only); call it for a new instance."""


def _checked(name: str, factory: Callable[[], object]) -> Factory:
    def build() -> TitoFamily:
        family = factory()
        if not isinstance(family, TitoFamily):
            raise ValueError(f"TITO family {name!r}: the factory returned {type(family)!r}")
        return family

    return build


def build_family(name: str) -> TitoFamily:
    """A new instance of the family `name` (a registered name or an import path). A
    constructor that fails raises a ValueError naming the family and where it failed (file,
    line, error), not its traceback."""
    factory = FAMILIES.get(name)
    try:
        family = factory()
    except Exception as e:  # noqa: BLE001  (a plug-in's constructor: any error is its own)
        raise ValueError(
            f"TITO family {name!r} could not be built: {raised_at(e)}{type(e).__name__}: {e}"
        ) from e
    return family
