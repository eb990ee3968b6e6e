"""Named plug-ins: one `Registry[T]` for every kind miles_core chooses by name in a config.

Trainer backends and losses (train/registry.py), rollout engines (engines/registry.py), weight transports
(weights/transport.py), TITO families (tito/registry.py), tasks (data/tasks.py) and per-token
fields (token_fields.py) are each one instance. An entry is registered under a short name, as the
object itself or as its import path `package.module:object` (imported on first use, so naming it
in a config costs nothing); a name that is not registered but holds a `:` is imported as a path.
Unknown names fail with the kind, the config key and the known names; `check(name)` is what
config validation calls: a registered name imports nothing, an import path is imported and
vetted. `import_object` is the import-path half alone (agent functions, hooks).
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "import_object"]


def _where(e: BaseException) -> str:
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
            raise error(f"cannot import {kind} {path!r}: {_where(e)}{type(e).__name__}: {e}") from e
        raise error(f"cannot import {kind} {path!r}: no module {module_name!r} ({e})") from e
    except Exception as e:  # the module itself fails (SyntaxError, raises at import): where
        raise error(f"cannot import {kind} {path!r}: {_where(e)}{type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise error(f"cannot import {kind} {path!r}: {module_name!r} has no {attr!r}")
    return obj


class Registry(Generic[T]):
    """Named objects of one kind.

    kind: what an entry is, in messages ("weight transport"); setting: the config key users
    write a name in ("weight_sync.transport"); example: the import-path form shown in errors;
    load: turns an imported object into a `T` (and raises ValueError when it is not one); it is
    applied to lazy entries and to import paths, not to objects registered directly.
    """

    def __init__(
        self,
        kind: str,
        setting: str = "",
        *,
        example: str = "package.module:object",
        load: Callable[[Any, str], T] | None = None,
    ) -> None:
        self.kind = kind
        self.setting = setting
        self.example = example
        self._load = load
        self._entries: dict[str, Any] = {}  # name -> T, or an import path not yet imported

    # ------------------------------------------------------------------ registering
    def register(self, name: str, obj: T | str) -> T | str:
        """Registers `obj` (or its import path, imported when first asked for) under `name`,
        replacing an earlier entry of that name. Returns `obj` (so it works as a decorator)."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and without ':'")
        self._entries[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    # ------------------------------------------------------------------ asking
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def values(self) -> list[T]:
        """Every entry, lazy ones imported (registration order)."""
        return [self.get(name) for name in list(self._entries)]

    def get(self, name: str) -> T:
        """The entry `name`, or the object at import path `name`; ValueError naming the known
        entries (or what is wrong with the import path) otherwise."""
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry, str):
                entry = self._entries[name] = self._import(entry, name)
            return entry
        if ":" in name:
            return self._import(name, name)
        raise self.unknown(name)

    def check(self, name: str) -> str:
        """Config-time check: a registered name passes without importing anything (validation
        stays free of torch); an import path is imported and vetted. Returns `name`."""
        if name not in self._entries:
            self.get(name)
        return name

    def unknown(self, name: str) -> ValueError:
        where = f" in {self.setting}" if self.setting else ""
        known = ", ".join(self.names()) or "none"
        return ValueError(
            f"unknown {self.kind} {name!r}{where}; known: {known} "
            f"(or give an import path '{self.example}')"
        )

    def _import(self, path: str, name: str) -> T:
        obj = import_object(path, self.kind, example=self.example)
        return self._load(obj, name) if self._load is not None else obj
