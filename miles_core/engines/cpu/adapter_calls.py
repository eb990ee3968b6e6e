"""SGLang's LoRA calls on the in-process engines (`load_lora_adapter`, `unload_lora_adapter`,
`load_lora_adapter_from_tensors`), over the engine's adapter table (lora/served.py), and the
per-request checks both engines make."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from miles_core.engines.cpu.disk_loads import max_load_bytes
from miles_core.engines.wire import EngineRequestError, GenerateRequest
from miles_core.lora.adapter import Adapter, pairs_of, read_adapter_dir
from miles_core.lora.served import AdapterRefused, ServedAdapters


def check_adapter(adapters: ServedAdapters | None, req: GenerateRequest) -> None:
    """EngineRequestError for a request naming an adapter that is not loaded, naming one on an
    engine without adapters, or naming none where every request must."""
    if adapters is None:
        if req.lora_path is not None:
            raise EngineRequestError(f"lora_path {req.lora_path!r}: this engine serves no adapters")
        return
    try:
        adapters.resolve(req.lora_path)
    except AdapterRefused as e:
        raise EngineRequestError(str(e)) from None


def rows_using(adapters: ServedAdapters | None, names: list[str | None]):
    """The forward's rows use adapters `names` (nothing to do without adapters)."""
    return contextlib.nullcontext() if adapters is None else adapters.rows(names)


class AdapterCalls:
    adapters: ServedAdapters | None

    def _adapter_turn(self):
        """Held around a change of the adapter table (the serving engine: between steps)."""
        return contextlib.nullcontext()

    def _table(self) -> ServedAdapters:
        if self.adapters is None:
            raise AdapterRefused("this engine serves no adapters (started without LoRA)")
        return self.adapters

    def load_lora_adapter(self, name: str, path: str | Path, upsert: bool = False) -> list[dict]:
        """Loads the peft directory `path` as adapter `name`; `upsert` replaces a loaded one of
        that name in place."""
        table = self._table()
        # a file larger than any weights of this model is refused unread
        limit = max_load_bytes(self.weights.tensors("base"))
        adapter = read_adapter_dir(path, name, max_bytes=limit)
        with self._adapter_turn():
            table.load(adapter, upsert=upsert)
            return table.listing()

    def load_lora_adapter_from_tensors(
        self, name: str, config: dict, tensors: dict[str, torch.Tensor], upsert: bool = False
    ) -> list[dict]:
        """Loads adapter `name` from peft-keyed tensors and its peft config; `upsert` replaces
        a loaded one of that name in place."""
        table = self._table()
        adapter = Adapter(name, dict(config), pairs_of(tensors))
        with self._adapter_turn():
            table.load(adapter, upsert=upsert)
            return table.listing()

    def unload_lora_adapter(self, name: str) -> list[dict]:
        table = self._table()
        with self._adapter_turn():
            table.unload(name)
            return table.listing()

    def lora_adapters(self) -> list[dict]:
        return [] if self.adapters is None else self.adapters.listing()
