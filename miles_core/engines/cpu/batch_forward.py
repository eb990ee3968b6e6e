"""How the embedded engine runs the model over one batch: a `BatchForward`.

A generate call prefills each distinct prompt once (a GRPO group's samples share one), then feeds
one token per row per step. Two forwards do that:

    hf      the model's own modules with a `DynamicCache` (any causal LM transformers loads)
    fast    the model family's own (Qwen3's: the serving engine's lean forward over a slot KV
            cache, fewer and fused ops per step from packed copies of the weights)

`batch_forward_for(model)` takes the fast forward of the model's family (`models/<family>/`:
`ModelFamily.fast_forward`, an import path `pkg.mod:factory`, used for the family's own model
class `hf_class`), else `hf`. A wrapped model (e.g. a peft adapter) has another class name and
gets `hf`, and so does a config the fast forward would not compute exactly (its factory raises
`ForwardUnsupported`). The forward holds whatever it derives from the weights, so the engine
tells it when they change (`invalidate`) and asks it to prove its copies equal the model's
(`stale`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from miles_core.models.family import family_of
from miles_core.plugins import import_object


class BatchForward(Protocol):
    def prefill(self, prompts: list[list[int]], row_prompt: list[int], length: int) -> torch.Tensor:
        """Runs each distinct prompt once; returns next-token logits [B, V] for the batch's B
        rows, row i extending `prompts[row_prompt[i]]`. A row that is still generating stays
        within `length` tokens; rows past it have finished (their outputs are not read).
        Starts a new batch."""
        ...

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per row (ids [B]); returns next-token logits [B, V]."""
        ...

    def use_adapters(self, adapters) -> None:
        """Adds the adapter terms of `adapters` (lora/served.py: its current rows) to the
        adapted linear layers from now on."""
        ...

    def invalidate(self) -> None:
        """The model's weights changed: drop anything derived from them."""
        ...

    def stale(self) -> list[str]:
        """Names of derived copies that differ bitwise from the model's weights ([] if none)."""
        ...


class ForwardUnsupported(ValueError):
    """A fast forward's factory raises this for a model config it would not compute exactly
    (e.g. a RoPE variant it lacks); `batch_forward_for` then uses `hf`."""


BatchForwardFactory = Callable[[torch.nn.Module], BatchForward]


def batch_forward_for(model: torch.nn.Module, pad_id: int, fast: bool = True) -> BatchForward:
    """The fast forward of the model's family, else (or with `fast=False`) `hf` (which
    left-pads prompts with `pad_id`)."""
    family = family_of(getattr(model.config, "model_type", None))
    if fast and family and family.fast_forward and type(model).__name__ == family.hf_class:
        factory: BatchForwardFactory = import_object(family.fast_forward, "fast forward")
        try:
            return factory(model)
        except ForwardUnsupported:  # this config has a feature the fast forward lacks
            pass
    from miles_core.engines.cpu.hf_forward import HFForward

    return HFForward(model, pad_id)
