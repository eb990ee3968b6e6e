"""The adapters an engine holds, and which rows of the current forward use which.

SGLang's LoRA serving, on our engines: adapters are loaded by name (`load`, from a peft directory
or from tensors), unloaded by name, at most `max_loaded` at once (a load past it is refused; an
adapter a queued or running request names is never unloaded or evicted), and every request names
its adapter (`lora_path`: a name, or None for the base model; with `required` None is refused,
the engine of a LoRA run reporting a request that forgot its adapter). A forward computes the
base layer for all rows and adds each row's adapter term (delta.py), unmerged, so rows with
different adapters (or none) share a batch.

A weight push carries adapter tensors under wire names (names.py); `load_wire` replaces the
named adapters' tensors all or nothing, in place of the version they replace (nothing
accumulates), requests in flight going on with the new tensors as with any weight update. A client
that treats the engine as one without in-place replacement loads each push as a version
`<name>@v<n>` instead (versions.py); `tensors` names a lone version as its adapter."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterable

import torch

from miles_core.lora.adapter import Adapter, config_scaling
from miles_core.lora.delta import LoraGroup
from miles_core.lora.names import SERVED_NAME, adapter_of, split_wire_name
from miles_core.lora.targets import SERVED, linear_modules

DEFAULT_MAX_LOADED = 8


class AdapterRefused(ValueError):
    """A load, unload or request the adapter table cannot take (the server answers 4xx)."""


class ServedAdapters:
    def __init__(
        self,
        linears: dict[str, tuple[int, int]],
        max_loaded: int = DEFAULT_MAX_LOADED,
        required: bool = False,
        device: torch.device | str = "cpu",
    ):
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.linears = linears
        self.max_loaded = max_loaded
        self.required = required
        self.device = torch.device(device)
        self.loaded: dict[str, Adapter] = {}
        self.in_use: Counter[str] = Counter()
        self._rows: list[Adapter | None] = []
        self._groups: dict[str, list[LoraGroup]] = {}

    # ------------------------------------------------------------------ loading
    def check(self, adapter: Adapter) -> None:
        """Refuses an adapter this model cannot serve: a bad name or config, a module the base
        lacks or the forward does not adapt, shapes of another base."""
        if not SERVED_NAME.fullmatch(adapter.name):
            raise AdapterRefused(
                f"adapter name {adapter.name!r}: use 1-64 letters, digits, '_' or '-', "
                "optionally followed by a version @v<number>"
            )
        cfg = adapter.config
        if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
            raise AdapterRefused(
                f"adapter {adapter.name}: peft_type {cfg.get('peft_type')!r} is not LORA"
            )
        try:
            rank = int(cfg["r"])
            scaling = config_scaling(cfg) if rank > 0 else 0.0
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise AdapterRefused(
                f"adapter {adapter.name}: config needs r and lora_alpha ({e!r})"
            ) from None
        if rank <= 0 or not math.isfinite(scaling):
            raise AdapterRefused(f"adapter {adapter.name}: rank {rank} / scaling {scaling} invalid")
        if not adapter.weights:
            raise AdapterRefused(f"adapter {adapter.name} holds no tensors")
        for module, (a, b) in adapter.weights.items():
            shape = self.linears.get(module)
            if shape is None:
                raise AdapterRefused(
                    f"adapter {adapter.name}: this base model has no linear module {module!r} "
                    "(an adapter for another base?)"
                )
            if not SERVED.fullmatch(module):
                raise AdapterRefused(
                    f"adapter {adapter.name}: {module} is not an attention, dense MLP or output "
                    "projection, which is what this engine adapts"
                )
            out_f, in_f = shape
            if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
                raise AdapterRefused(
                    f"adapter {adapter.name}: {module} has A {list(a.shape)}, B {list(b.shape)}; "
                    f"this base needs A [{rank}, {in_f}], B [{out_f}, {rank}] (an adapter for "
                    "another base, or another rank than its config's r?)"
                )
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterRefused(f"adapter {adapter.name}: {module} tensors are not floats")

    def load(self, adapter: Adapter, upsert: bool = False) -> None:
        self.check(adapter)
        if adapter.name in self.loaded and not upsert:
            raise AdapterRefused(
                f"adapter {adapter.name} is already loaded: unload it first, or load with upsert"
            )
        if adapter.name not in self.loaded and len(self.loaded) >= self.max_loaded:
            raise AdapterRefused(
                f"{len(self.loaded)} adapters are loaded, the most this engine holds "
                f"(max_loaded_loras {self.max_loaded}): unload one first "
                f"(loaded: {sorted(self.loaded)})"
            )
        weights = {m: (self._own(a), self._own(b)) for m, (a, b) in adapter.weights.items()}
        self.loaded[adapter.name] = Adapter(adapter.name, dict(adapter.config), weights)
        self._groups = {}

    def declare(self, name: str, config: dict) -> None:
        """Loads adapter `name` of `config` (peft's; target_modules as full module names) with
        zero tensors: until a push brings its weights it computes exactly the base, as the
        trainer's freshly initialised adapter (B = 0) does."""
        weights = {}
        rank = int(config["r"])
        for module in config.get("target_modules") or []:
            shape = self.linears.get(module)
            if shape is None:
                raise AdapterRefused(f"adapter {name}: this base model has no linear {module!r}")
            out_f, in_f = shape
            weights[module] = (torch.zeros(rank, in_f), torch.zeros(out_f, rank))
        self.load(Adapter(name, config, weights))

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device, torch.float32).clone()

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise AdapterRefused(f"adapter {name!r} is not loaded (loaded: {sorted(self.loaded)})")
        if self.in_use[name]:
            raise AdapterRefused(
                f"adapter {name} is in use by {self.in_use[name]} queued or running requests"
            )
        del self.loaded[name]
        self._groups = {}

    def load_wire(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replaces loaded adapters' tensors from a push (wire names), all or nothing: each
        adapter named must be loaded, and the push must carry every tensor it holds."""
        by_adapter: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        for name, t in named:
            adapter, module, part = split_wire_name(name)
            by_adapter.setdefault(adapter, {}).setdefault(module, {})[part] = t
        fresh = []
        for name, modules in by_adapter.items():
            held = self.loaded.get(name)
            if held is None:
                raise KeyError(
                    f"the push carries adapter {name!r}, which this engine has not loaded "
                    "(load it with its config first: load_lora_adapter_from_tensors)"
                )
            if set(modules) != set(held.weights) or any(len(p) != 2 for p in modules.values()):
                raise ValueError(f"a push of adapter {name} must carry all its tensors")
            pairs = {m: (p["lora_A"], p["lora_B"]) for m, p in modules.items()}
            candidate = Adapter(name, held.config, pairs)
            try:
                self.check(candidate)
            except AdapterRefused as e:
                raise ValueError(str(e)) from None
            fresh.append(candidate)
        for adapter in fresh:
            self.load(adapter, upsert=True)
        return sum(a.nbytes() for a in fresh)

    # ------------------------------------------------------------------ what is held
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every loaded adapter's tensors by wire name: a version (`<name>@v<n>`) under its
        adapter's name when it is that adapter's only one loaded, as the trainer names it; else
        under its own, so a stale version beside the current one never matches the trainer."""
        versions = Counter(adapter_of(name) for name in self.loaded)
        out: dict[str, torch.Tensor] = {}
        for name, adapter in self.loaded.items():
            alone = versions[adapter_of(name)] == 1
            out |= adapter.wire_tensors(adapter_of(name) if alone else name)
        return out

    def listing(self) -> list[dict]:
        return [
            {"name": a.name, "rank": a.rank, "in_use": self.in_use[a.name]}
            for a in self.loaded.values()
        ]

    # ------------------------------------------------------------------ requests and rows
    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a request names; AdapterRefused for an unknown one, or for none when
        every request must name one."""
        if name is None:
            if self.required:
                raise AdapterRefused(
                    "this engine serves a LoRA run: every request must name its adapter "
                    f"(lora_path; loaded: {sorted(self.loaded)})"
                )
            return None
        adapter = self.loaded.get(name)
        if adapter is None:
            raise AdapterRefused(
                f"lora_path {name!r}: no such adapter is loaded (loaded: {sorted(self.loaded)})"
            )
        return adapter

    @contextlib.contextmanager
    def rows(self, names: list[str | None]):
        """The current forward's rows, row i using adapter `names[i]` (None: the base)."""
        self._rows = [self.resolve(n) if n is not None else None for n in names]
        self._groups = {}
        try:
            yield self
        finally:
            self._rows, self._groups = [], {}

    def groups(self, module: str) -> list[LoraGroup]:
        cached = self._groups.get(module)
        if cached is not None:
            return cached
        by_adapter: dict[str, list[int]] = {}
        for i, a in enumerate(self._rows):
            if a is not None and module in a.weights:
                by_adapter.setdefault(a.name, []).append(i)
        groups = []
        for name, idx in by_adapter.items():
            a, b = self.loaded[name].weights[module]
            rows = None
            if len(idx) < len(self._rows):
                rows = torch.tensor(idx, dtype=torch.long, device=self.device)
            groups.append(LoraGroup(a, b, self.loaded[name].scaling, rows))
        self._groups[module] = groups
        return groups

    @property
    def active(self) -> bool:
        """Whether any row of the current forward uses an adapter."""
        return any(a is not None for a in self._rows)


def served_adapters(
    model: torch.nn.Module, spec: dict | None, device="cpu"
) -> ServedAdapters | None:
    """An engine's adapter table from its `lora` spec (None: the engine serves no adapters):
    `max_loaded`, `required`, and `adapters` {name: peft config} declared at start."""
    if spec is None:
        return None
    adapters = ServedAdapters(
        linear_modules(model),
        int(spec.get("max_loaded", DEFAULT_MAX_LOADED)),
        bool(spec.get("required", False)),
        device,
    )
    for name, config in (spec.get("adapters") or {}).items():
        adapters.declare(name, config)
    return adapters
