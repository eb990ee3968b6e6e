"""The weights an engine holds, by name: what pushes write, checks read and the forward uses.

Without a plan these are the model's parameters. With one (`rollout.precision`), a quantized
weight is held as the parts it was pushed as (e.g. E4M3 bytes and their scales) and the
model's parameter holds their dequantized values: the GEMM computes with exactly what the
parts stand for (dequantize-then-GEMM, the CPU emulation of a low-precision kernel). A load is
all or nothing: names, shapes and dtypes are checked, and every quantized weight it touches
must come with all its parts, before anything is copied."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles_core.engines.cpu.loading import load_named_tensors
from miles_core.lora.names import is_wire_name
from miles_core.lora.served import ServedAdapters
from miles_core.precision.plan import QuantPlan

# what a weights checksum covers: everything served, the base model's tensors, or the adapters
SCOPES = ("all", "base", "adapters")


class ServedWeights:
    def __init__(
        self,
        params: dict[str, torch.Tensor],
        plan: QuantPlan | None = None,
        adapters: ServedAdapters | None = None,
    ):
        self.params = params
        self.plan = plan
        self.adapters = adapters  # LoRA: pushed adapter tensors (wire names) are loaded there
        self.parts: dict[str, torch.Tensor] = {}
        self._owner: dict[str, str] = {}  # part name → the weight it belongs to
        self.quantized: frozenset[str] = frozenset()  # the weights held as parts
        if plan is None:
            return
        self.layout = plan.layout(params)
        for name, p in params.items():
            if plan.quantized(name, p.shape):
                for part in plan.parts_of(name, tuple(p.shape)):
                    self._owner[part] = name
        self.quantized = frozenset(self._owner.values())
        # the engine starts on the quantized values of the weights it was built with
        initial = plan.export((n, p.detach()) for n, p in params.items() if n in self.quantized)
        self.load(initial.items())

    def tensors(self, scope: str = "all") -> dict[str, torch.Tensor]:
        """The served tensors by name: the base model's (quantized ones as their parts), the
        loaded adapters' (wire names), or both."""
        if scope not in SCOPES:
            raise ValueError(f"unknown weights scope {scope!r}; choose one of {SCOPES}")
        adapters = self.adapters.tensors() if self.adapters is not None else {}
        if scope == "adapters":
            return adapters
        out = {n: p.detach() for n, p in self.params.items() if n not in self.quantized}
        base = out | self.parts
        return base if scope == "base" else base | adapters

    def load(self, named: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> int:
        pairs = list(named)
        lora = [(n, t) for n, t in pairs if is_wire_name(n)]
        if lora:
            if self.adapters is None:
                raise KeyError(f"engine serves no adapters, but the push carries {lora[0][0]!r}")
            if len(lora) != len(pairs):
                raise ValueError("a push carries adapters or base weights, not both")
            return self.adapters.load_wire(lora)
        if self.plan is None:
            return load_named_tensors(self.params, pairs, adopt=adopt)
        parts = {n: t for n, t in pairs if n in self._owner}
        plain = [(n, t) for n, t in pairs if n not in self._owner]
        for name, t in parts.items():
            shape, dtype = self.layout[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"{name}: engine holds {dtype} {list(shape)}, pushed {t.dtype} "
                    f"{list(t.shape)} (rollout.precision {self.plan.name})"
                )
        touched = {self._owner[n] for n in parts}
        for w in sorted(touched):
            missing = [p for p in self.plan.parts_of(w, tuple(self.params[w].shape))
                       if p not in parts]  # fmt: skip
            if missing:
                raise ValueError(f"{w}: a push must carry all its parts; missing {missing}")
        floats = [n for n, _ in plain if n in self.quantized]
        if floats:
            raise KeyError(
                f"engine holds {floats[0]!r} quantized ({self.plan.name}): push its parts "
                f"{self.plan.parts_of(floats[0], tuple(self.params[floats[0]].shape))}"
            )
        copied = load_named_tensors(self.params, plain, adopt=adopt)
        with torch.no_grad():
            for name, t in parts.items():
                self.parts[name] = t if adopt else t.detach().clone()
            for w in touched:
                p = self.params[w]
                p.copy_(self.plan.dequantize(self.parts, w, tuple(p.shape)).to(p.dtype))
        return copied + sum(t.numel() * t.element_size() for t in parts.values())

    def stale(self) -> list[str]:
        """Quantized weights whose parameter is not exactly their parts' dequantized values."""
        if self.plan is None:
            return []
        out = []
        for w in sorted(self.quantized):
            p = self.params[w]
            values = self.plan.dequantize(self.parts, w, tuple(p.shape)).to(p.dtype)
            if not torch.equal(p.detach(), values):
                out.append(w)
        return out
