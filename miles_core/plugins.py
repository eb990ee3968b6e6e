"""Named plug-ins: one `Registry[T]` for every kind miles_core chooses by name in a config.

A plug-in registers itself beside its definition, one way for every kind:

    @TRANSPORTS.register("disk")
    class DiskTransport(TransportBase): ...

    SAY_A = TASKS.register("say_a", SayA())       # an instance: the call form

A registry with a `package` finds its built-ins without importing them: the plug-in `x` is the
module `package.x` (or, for a module holding several, `package.x` for every name `x_...`),
imported the first time `x` is asked for; so naming one in a config costs nothing until it is
used, and a new built-in is one file in that folder. A name that is not registered but holds a
`:` is an import path `package.module:object`, imported and vetted. Unknown names fail with the
kind, the config key and the known names.

A plug-in owns its options: its `Options` attribute, a pydantic model, validates the mapping a
config gives under the plug-in key's `*_options` (`options(name, raw)`); a plug-in without one
takes none. `import_object` is the import-path half alone (agent functions, hooks).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")

__all__ = [
    "NoOptions",
    "PluginOptions",
    "Registry",
    "import_object",
    "raised_at",
    "subclass_of",
]


class PluginOptions(BaseModel):
    """The base of every plug-in's options: unknown keys and NaN/inf are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class NoOptions(PluginOptions):
    """The options of a plug-in that takes none."""


def subclass_of(base: type, kind: str) -> Callable[[Any, str], Any]:
    """A registry's `load` hook that takes only subclasses of `base` (a ValueError naming the
    `kind` and the entry otherwise)."""

    def load(obj: Any, name: str) -> Any:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise ValueError(f"{kind} {name!r} is not a {base.__name__} subclass: {obj!r}")
        return obj

    return load


def raised_at(e: BaseException) -> str:
    """'FILE:LINE: ' of an error raised while importing a module: the line a SyntaxError names,
    else the innermost frame of its traceback (the plug-in's own code, or what it called)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: "
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""


def import_object(
    path: str,
    kind: str,
    *,
    example: str = "package.module:object",
    error: type[Exception] = ValueError,
) -> Any:
    """The object at import path `package.module:attr` (`attr` may be dotted); `error` (a
    ValueError by default) naming `kind` and what is wrong otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{kind} {path!r}: expected '{example}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and missing != module_name and not module_name.startswith(f"{missing}."):
            # the module exists, and an import inside it fails: where
            raise error(
                f"cannot import {kind} {path!r}: {raised_at(e)}{type(e).__name__}: {e}"
            ) from e
        raise error(f"cannot import {kind} {path!r}: {_not_found(module_name)}") from e
    except Exception as e:  # the module itself fails (SyntaxError, raises at import): where
        raise error(f"cannot import {kind} {path!r}: {raised_at(e)}{type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise error(f"cannot import {kind} {path!r}: {module_name!r} has no {attr!r}")
    return obj


def _not_found(module_name: str) -> str:
    """What was searched for a module that is not there, and how to make it found."""
    top = module_name.split(".")[0]
    if top != module_name:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            where = spec.origin or ", ".join(spec.submodule_search_locations or [])
            return f"no module {module_name!r}: package {top!r} (at {where}) has none of that name"
    install = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix)}
    folders = []
    for entry in sys.path:
        folder = Path(entry or os.getcwd()).resolve()
        if folder.is_dir() and not any(folder.is_relative_to(i) for i in install):
            folders.append(str(folder))
    searched = ", ".join(dict.fromkeys(folders)) or "no folder of yours"
    return (
        f"no module {module_name!r} in the folders searched ({searched}) or the installed "
        f"packages; run from the folder that holds {top}/ (or {top}.py), or add that folder to "
        f"PYTHONPATH: PYTHONPATH=/path/to/that/folder miles ..."
    )


_MISSING: Any = object()


class Registry(Generic[T]):
    """Named objects of one kind.

    kind: what an entry is, in messages ("weight transport"); setting: the config key users
    write a name in ("weight_sync.transport"); package: the folder of the built-ins, one module
    per plug-in (see the module docstring); example: the import-path form shown in errors;
    load: turns a registered or imported object into a `T` (and raises ValueError when it is
    not one), e.g. a class into its instance.
    """

    def __init__(
        self,
        kind: str,
        setting: str = "",
        *,
        package: str | None = None,
        example: str = "package.module:object",
        load: Callable[[Any, str], T] | None = None,
    ) -> None:
        self.kind = kind
        self.setting = setting
        self.package = package
        self.example = example
        self._load = load
        self._entries: dict[str, Any] = {}  # name -> T, or an import path not yet imported

    # ------------------------------------------------------------------ registering
    def register(self, name: str, obj: Any = _MISSING) -> Any:
        """Registers `obj` under `name` and returns what was registered; without `obj`, a
        decorator that does so (`@REGISTRY.register("name")` above a class or function). `obj`
        may also be an import path, imported the first time `name` is asked for."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and without ':'")
        if obj is _MISSING:
            return lambda o: self._add(name, o, decorated=True)
        return self._add(name, obj, decorated=False)

    def _add(self, name: str, obj: Any, decorated: bool) -> Any:
        entry = obj if isinstance(obj, str) else self._loaded(obj, name)
        self._entries[name] = entry
        return obj if decorated else entry  # a decorator leaves the class or function as it is

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    # ------------------------------------------------------------------ asking
    def names(self) -> list[str]:
        """Every name, the package's built-ins included (imported, so a module registering
        several names lists them all)."""
        for module in self._package_modules():
            self._import_module(module)
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            name in self._entries or self._module_of(name) is not None
        )

    def values(self) -> list[T]:
        """Every entry, lazy ones imported (registration order)."""
        return [self.get(name) for name in self.names()]

    def get(self, name: str) -> T:
        """The entry `name` (a built-in of the package is imported now), or the object at
        import path `name`; ValueError naming the known entries (or what is wrong with the
        import path) otherwise."""
        if name not in self._entries and (module := self._module_of(name)) is not None:
            self._import_module(module)
            if name not in self._entries:
                raise ValueError(f"{module} registers no {self.kind} named {name!r}")
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry, str):
                entry = self._entries[name] = self._import(entry, name)
            return entry
        if ":" in name:
            return self._import(name, name)
        raise self.unknown(name)

    def check(self, name: str) -> str:
        """Config-time check: a registered name or a built-in of the package passes without
        importing anything; an import path is imported and vetted. Returns `name`."""
        if name not in self:
            self.get(name)
        return name

    def options(self, name: str, raw: Any = None) -> PluginOptions:
        """`raw` (a mapping, or options already built) validated against the options class of
        plug-in `name` (its `Options` attribute; none: only an empty mapping passes); errors
        name the config key."""
        cls = getattr(self.get(name), "Options", NoOptions)
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"{self.setting}_options must be a mapping, got {raw!r}")
        if cls is NoOptions and raw:
            raise ValueError(
                f"{self.kind} {name!r} takes no options; {self.setting}_options has "
                f"{', '.join(map(str, raw))}"
            )
        return cls.model_validate(raw or {})

    def unknown(self, name: str) -> ValueError:
        where = f" in {self.setting}" if self.setting else ""
        known = ", ".join(self.names()) or "none"
        return ValueError(
            f"unknown {self.kind} {name!r}{where}; known: {known} "
            f"(or give an import path '{self.example}')"
        )

    # ------------------------------------------------------------------ internals
    def _loaded(self, obj: Any, name: str) -> T:
        return self._load(obj, name) if self._load is not None else obj

    def _import(self, path: str, name: str) -> T:
        return self._loaded(import_object(path, self.kind, example=self.example), name)

    def _package_modules(self) -> list[str]:
        if self.package is None:
            return []
        package = importlib.import_module(self.package)
        return [
            f"{self.package}.{m.name}"
            for m in pkgutil.iter_modules(package.__path__)
            if not m.name.startswith("_")
        ]

    def _module_of(self, name: str) -> str | None:
        """The package's module that registers `name`: `package.name`, else `package.x` for
        the longest `x` with `name` = `x_...`."""
        if self.package is None or ":" in name or not name.isidentifier():
            return None
        parts = name.split("_")
        for i in range(len(parts), 0, -1):
            module = f"{self.package}.{'_'.join(parts[:i])}"
            if module.rpartition(".")[2] and importlib.util.find_spec(module) is not None:
                return module
        return None

    def _import_module(self, module: str) -> None:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise ValueError(
                f"cannot import {self.kind} module {module}: {raised_at(e)}{type(e).__name__}: {e}"
            ) from e
