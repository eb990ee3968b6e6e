"""Trainer plug-ins by name: backends (`train.backend`) and, through the same `Registry`, losses.

A name is either registered (`register_backend("fsdp", "miles_core.train.fsdp:FSDPBackend")`;
the entry may be the object itself or its import path, imported on first use) or an import path
`package.module:object` given in the config. Follower ranks rebuild rank 0's backend from
`backend_path(type(backend))`, so a backend defined outside miles_core works under torchrun too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_core.plugins import Registry

BACKENDS: Registry[Callable[..., Any]] = Registry("trainer backend", "train.backend")
BACKENDS.register("fsdp", "miles_core.train.fsdp:FSDPBackend")
BACKENDS.register("megatron", "miles_core.train.megatron.backend:MegatronBackend")


def register_backend(name: str, factory: Callable[..., Any] | str) -> None:
    """`factory(model_dir=, optim=, loss=, total_steps=, seed=, device=)` → a `TrainerBackend`,
    or its import path."""
    BACKENDS.register(name, factory)


def backend_names() -> list[str]:
    return BACKENDS.names()


def backend_factory(name: str) -> Callable[..., Any]:
    factory = BACKENDS.get(name)
    if not callable(factory):
        raise ValueError(f"trainer backend {name!r} is not a class or factory: {factory!r}")
    return factory


def check_backend(name: str) -> str:
    """Config-time check: `name` is registered (not imported: config validation stays free of
    torch) or an import path to a factory (raises otherwise)."""
    if name not in BACKENDS:
        backend_factory(name)
    return name


def make_backend(name: str, **kwargs: Any):
    """Builds the backend `name` (registered name or import path) with the keyword arguments
    every backend takes: model_dir, optim, loss, total_steps, seed, device."""
    return backend_factory(name)(**kwargs)


def backend_path(cls: type) -> str:
    """The import path that rebuilds `cls` in another process (a follower rank)."""
    return f"{cls.__module__}:{cls.__qualname__}"


LOSSES: Registry[Any] = Registry("loss", "train.loss")
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
    loss = LOSSES.get(name)
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
    if name not in LOSSES:
        get_loss(name)
    return name
