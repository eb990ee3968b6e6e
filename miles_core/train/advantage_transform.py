"""Advantage transforms: per-token changes to the advantages an estimator gave, applied in the
policy loss after any estimator (`train.advantage_transforms: {name: options}`, in order).

An estimator gives one advantage per sample from its group's rewards (`advantage.py`); a
transform turns those into per-token advantages [B, R] from what the micro-batch carries: its
declared per-token fields (`token_fields.py`) and π_old's log-probs. Distillation's
`Â_t = A_t − λ·(log π_old(y_t) − log π_teacher(y_t))` is one (`advantage_transforms/opd.py`).

A transform is a class in `train/advantage_transforms/` (`@ADVANTAGE_TRANSFORMS.register(name)`)
or one named by import path; its settings are its `Options`, validated when the config is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from miles_core.plugins import PluginOptions, Registry

if TYPE_CHECKING:
    from miles_core.train.forward import MicroBatch


class AdvantageTransform(Protocol):
    Options: type[PluginOptions]

    def fields(self, options: Any) -> list[str]:
        """The per-token fields (`token_fields.py`) it reads: a batch without them is refused."""
        ...

    def __call__(
        self, advantages: torch.Tensor, old: torch.Tensor, mb: MicroBatch, options: Any
    ) -> torch.Tensor:
        """advantages [B, R] (per token, no gradient) → the transformed advantages [B, R].
        `old`: π_old's log-probs [B, R] (detached); padding positions are masked later."""
        ...


def _transform(obj: Any, name: str) -> Any:
    """A registered or imported transform as an instance (a class is built without arguments)."""
    t = obj() if isinstance(obj, type) else obj
    if not callable(t) or not hasattr(t, "fields"):
        raise ValueError(
            f"advantage transform {name!r} needs __call__(advantages, old, mb, options) and "
            f"fields(options): {obj!r}"
        )
    return t


ADVANTAGE_TRANSFORMS: Registry[Any] = Registry(
    "advantage transform",
    "train.advantage_transforms",
    package="miles_core.train.advantage_transforms",
    example="package.module:Class",
    load=_transform,
)


def transformed(
    advantages: torch.Tensor, old: torch.Tensor, mb: MicroBatch, transforms: dict[str, Any]
) -> torch.Tensor:
    """`advantages` [B, R] through each of `transforms` (name → its options), in order."""
    for name, options in transforms.items():
        t = ADVANTAGE_TRANSFORMS.get(name)
        missing = [f for f in t.fields(options) if f not in mb.padded.fields]
        if missing:
            raise ValueError(
                f"advantage transform {name} reads the per-token field(s) {missing}, which the "
                f"batch does not carry (its fields: {sorted(mb.padded.fields) or 'none'})"
            )
        advantages = t(advantages, old, mb, options)
    return advantages
