"""Trainer plug-ins by name: backends (`train.backend`) and, through the same `Registry`, losses.

A name is either registered (`register_backend("fsdp", "miles_core.train.fsdp:FSDPBackend")`;
the entry may be the object itself or its import path, imported on first use) or an import path
`package.module:object` given in the config. Follower ranks rebuild rank 0's backend from
`backend_path(type(backend))`, so a backend defined outside miles_core works under torchrun too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """Named objects of one kind; entries may be import paths, resolved when first asked for."""

    def __init__(self, kind: str, setting: str):
        self.kind = kind  # "trainer backend", "loss"
        self.setting = setting  # the config key users write it in, for error messages
        self._entries: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must not contain ':' (import paths do)")
        self._entries[name] = obj

    def names(self) -> list[str]:
        return sorted(self._entries)

    def resolve(self, name: str) -> Any:
        """The object registered as `name`, or the one at import path `name`; a clear error
        naming the known entries otherwise."""
        if name in self._entries:
            entry = self._entries[name]
            if isinstance(entry, str):
                entry = self._entries[name] = _import(entry, self.kind)
            return entry
        if ":" in name:
            return _import(name, self.kind)
        raise ValueError(
            f"unknown {self.kind} {name!r} in {self.setting}; known: "
            f"{', '.join(self.names())} (or give an import path 'package.module:object')"
        )


def _import(path: str, kind: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} {path!r}: expected 'package.module:object'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {path!r}: cannot import {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{kind} {path!r}: {module_name!r} has no {attr!r}")
    return obj


BACKENDS = Registry("trainer backend", "train.backend")
BACKENDS.register("fsdp", "miles_core.train.fsdp:FSDPBackend")


def register_backend(name: str, factory: Callable[..., Any] | str) -> None:
    """`factory(model_dir=, optim=, loss=, total_steps=, seed=, device=)` → a `TrainerBackend`,
    or its import path."""
    BACKENDS.register(name, factory)


def backend_names() -> list[str]:
    return BACKENDS.names()


def backend_factory(name: str) -> Callable[..., Any]:
    factory = BACKENDS.resolve(name)
    if not callable(factory):
        raise ValueError(f"trainer backend {name!r} is not a class or factory: {factory!r}")
    return factory


def check_backend(name: str) -> str:
    """Config-time check: `name` is registered (not imported: config validation stays free of
    torch) or an import path to a factory (raises otherwise)."""
    if name not in BACKENDS.names():
        backend_factory(name)
    return name


def make_backend(name: str, **kwargs: Any):
    """Builds the backend `name` (registered name or import path) with the keyword arguments
    every backend takes: model_dir, optim, loss, total_steps, seed, device."""
    return backend_factory(name)(**kwargs)


def backend_path(cls: type) -> str:
    """The import path that rebuilds `cls` in another process (a follower rank)."""
    return f"{cls.__module__}:{cls.__qualname__}"


LOSSES = Registry("loss", "train.loss")
LOSSES.register("policy", "miles_core.train.losses.policy:PolicyLoss")
LOSSES.register("sft", "miles_core.train.losses.sft:SFTLoss")
# "distill" (on-policy distillation against teacher log-probs) registers here when it lands


def register_loss(name: str, loss: Any) -> None:
    """A `miles_core.train.losses.base.Loss` (an instance, a class built without arguments, or
    an import path to either) under `name`."""
    LOSSES.register(name, loss)


def loss_names() -> list[str]:
    return LOSSES.names()


def get_loss(name: str):
    """The loss registered as `name`, or at import path `name` (a class is instantiated)."""
    loss = LOSSES.resolve(name)
    if isinstance(loss, type):
        loss = loss()
    missing = [
        m for m in ("config", "aggregation", "needs") if not callable(getattr(loss, m, None))
    ]
    if missing or not callable(loss):
        raise ValueError(
            f"loss {name!r} is not a loss: it needs config(settings), aggregation(cfg), "
            "needs(cfg) and __call__(out, micro_batch, cfg, denom)"
        )
    return loss


def check_loss(name: str) -> str:
    """Config-time check: `name` is a registered loss (not imported) or an import path to one
    (raises otherwise)."""
    if name not in LOSSES.names():
        get_loss(name)
    return name
