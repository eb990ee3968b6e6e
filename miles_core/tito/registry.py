"""The TITO family registry: a family is named by a registered name (`tiny`, `qwen3`, `mistral`:
each built-in registers itself in its own module) or by an import path `package.module:obj`, where
`obj` is a `TitoFamily` subclass, a zero-argument factory returning one, or an instance. A new
family is a file anywhere on the path; nothing in miles_core changes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from miles_core.plugins import Registry
from miles_core.tito.family import TitoFamily

Factory = Callable[[], TitoFamily]
F = TypeVar("F", bound=Factory)


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
    "TITO family", "agent.family", example="package.module:Class", load=_as_factory
)


def register_family(name: str, factory: F | None = None) -> F | Callable[[F], F]:
    """Register `factory` (a `TitoFamily` subclass or a zero-argument function returning a
    family) under `name`; used as a decorator when `factory` is omitted."""

    def add(f: F) -> F:
        if not callable(f):
            raise TypeError(f"TITO family {name!r}: {f!r} is not a class or a factory")
        FAMILIES.register(name, f)
        return f

    return add if factory is None else add(factory)


def family_names() -> list[str]:
    """The registered family names, sorted."""
    return FAMILIES.names()


def describe_choices() -> str:
    """For help strings and errors: the registered names and the import-path form."""
    return f"{', '.join(family_names())}, or 'package.module:Class'"


def resolve_family(name: str) -> Factory:
    """The factory of a registered name or an import path, without building the family (a
    family may load a large tokenizer): what config validation calls. ValueError if unknown."""
    return FAMILIES.get(name)


def _checked(name: str, factory: Callable[[], object]) -> Factory:
    def build() -> TitoFamily:
        family = factory()
        if not isinstance(family, TitoFamily):
            raise ValueError(f"TITO family {name!r}: the factory returned {type(family)!r}")
        return family

    return build


def get_family(name: str) -> TitoFamily:
    """A new instance of the family `name` (a registered name or 'package.module:obj')."""
    return resolve_family(name)()
