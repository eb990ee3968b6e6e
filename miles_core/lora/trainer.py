"""The trainer's side: peft's LoRA layers injected into the HF model in place (module and
parameter names stay the model's: `<module>.base_layer.weight`, `<module>.lora_A.<adapter>.weight`),
the base frozen and never merged.

Imports peft only when a run trains adapters."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from miles_core.lora.adapter import Adapter, peft_config
from miles_core.lora.delta import LoraGroup
from miles_core.lora.names import wire_name
from miles_core.lora.targets import resolve_targets


def inject(model: torch.nn.Module, settings: dict[str, Any]) -> list[str]:
    """Adds the adapters of `settings` (train.lora, as a dict) to every target module; freezes
    everything else. Returns the adapted module names. peft initialises A by Kaiming-uniform and
    B to zero, so the adapted model computes exactly what the base does."""
    from peft import LoraConfig, inject_adapter_in_model

    modules = resolve_targets(model, settings["target_modules"], settings["exclude_modules"])
    config = LoraConfig(
        r=settings["rank"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        use_rslora=settings["rslora"],
        target_modules=modules,
        bias="none",
    )
    with warnings.catch_warnings():
        # a tied output layer adapted: peft warns about merging it, which is never done here
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        # several adapters are injected one by one (multi-LoRA), which peft warns about
        warnings.filterwarnings("ignore", message=".*Already found a `peft_config`.*")
        for name in settings["adapters"]:
            inject_adapter_in_model(config, model, adapter_name=name)
    adapted = set(lora_layers(model))
    if adapted != set(modules):  # the engines serve `modules`: anything else would drift apart
        raise ValueError(
            f"peft adapted {sorted(adapted ^ set(modules))[:4]} beside or instead of the "
            "modules train.lora resolved; the engines would serve another model than the trainer's"
        )
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    return modules


def activate(model: torch.nn.Module, name: str) -> None:
    """Adapter `name` computes in every adapted layer (and only its parameters take
    gradients); the others are kept as they are."""
    for layer in lora_layers(model).values():
        layer.set_adapter(name)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The model computes as its frozen base inside the block (a LoRA run's KL reference: no
    second copy of the model)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{HF module name: peft LoRA layer}."""
    return {
        n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
    }


class PeftTerms:
    """`LoraTerms` (delta.py) of the trainer's peft layers: each module's active adapter over
    every row, with its dropout (an identity outside training)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = lora_layers(model)

    def groups(self, module: str) -> list[LoraGroup]:
        m = self.layers.get(module)
        if m is None or m.disable_adapters:
            return []
        return [
            LoraGroup(m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a], None, m.lora_dropout[a])
            for a in m.active_adapters
            if a in m.lora_A
        ]


def adapter_parameters(
    model: torch.nn.Module, adapter: str
) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(module, part, parameter) of one adapter, in the model's parameter order."""
    out = []
    for n, p in model.named_parameters():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.{adapter}.weight"
            if n.endswith(suffix):
                out.append((n[: -len(suffix)], part, p))
    return out


def pushed_parameters(
    model: torch.nn.Module, adapters: list[str]
) -> list[tuple[str, torch.nn.Parameter]]:
    """What a weight push sends with LoRA on: every adapter's parameters, by wire name."""
    return [
        (wire_name(a, module, part), p)
        for a in adapters
        for module, part, p in adapter_parameters(model, a)
    ]


def adapter_of(
    model: torch.nn.Module, settings: dict[str, Any], name: str, modules: list[str], full=None
) -> Adapter:
    """Adapter `name` as the trainer holds it (full tensors: `full(param)` unshards one)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for module, part, p in adapter_parameters(model, name):
            t = full(p) if full is not None else p.detach()
            pairs.setdefault(module, {})[part] = t.detach().clone().cpu()
    weights = {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items()}
    return Adapter(name, adapter_config(settings, modules), weights)


def adapter_config(settings: dict[str, Any], modules: list[str]) -> dict[str, Any]:
    """The peft config of an adapter of `settings` (train.lora) on `modules`."""
    return peft_config(
        settings["rank"], settings["alpha"], modules, settings["dropout"], settings["rslora"]
    )
