"""SGLang's LoRA routes on the engine server (`/load_lora_adapter`, `/unload_lora_adapter`,
`/load_lora_adapter_from_tensors`), answering its `LoRAUpdateOutput` (`success`,
`error_message`, `loaded_adapters`); `/get_server_info` lists the loaded adapters.

A directory load reads only under the server's weight roots (the real paths of the directory
and of both files). Tensors arrive as one safetensors payload, base64 in the JSON body
(`serialized_named_tensors: [payload]`, `load_format: safetensors`): SGLang's default payload is
a pickle, which this server never unpickles (a pickle can import and run anything the client
chooses)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from typing import Any, ClassVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from miles_core.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from miles_core.lora.served import AdapterRefused
from miles_core.processes.roots import AllowedRoots, RootRefusal


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoadLoraBody(_Body):
    lora_name: str
    lora_path: str
    pinned: bool = False
    upsert: bool = False  # ours: replace a loaded adapter of this name in place
    extensions: ClassVar[frozenset[str]] = frozenset({"upsert"})


class UnloadLoraBody(_Body):
    lora_name: str


class LoraTensorsBody(_Body):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]  # one payload (SGLang: one per tensor-parallel rank)
    load_format: str | None = None
    pinned: bool = False
    # sglang-miles' extension: replace a loaded adapter of this name in place
    upsert: bool = False
    extensions: ClassVar[frozenset[str]] = frozenset({"upsert"})


def _answer(engine, error: str | None = None) -> JSONResponse:
    body = {
        "success": error is None,
        "error_message": error or "",
        "loaded_adapters": {a["name"]: a for a in engine.lora_adapters()},
    }
    if error is not None:
        body["message"] = error
        body["error"] = {"message": error}
    return JSONResponse(status_code=400 if error else 200, content=body)


def _adapter_dir(roots: AllowedRoots, path: str) -> str:
    """The real path of a peft directory under the roots, both its files inside them too."""
    real = roots.check(path, "lora_path")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.realpath(os.path.join(real, name))
        if not roots.contains_local(file):
            raise RootRefusal(f"lora_path {path!r}: {name} lies outside the weight roots")
    return real


def add_lora_routes(app: FastAPI, engine, roots: AllowedRoots) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraBody):
        try:
            real = _adapter_dir(roots, body.lora_path)
            await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, real, body.upsert)
        except (AdapterRefused, RootRefusal, ValueError, OSError) as e:
            return _answer(engine, f"cannot load adapter {body.lora_name!r}: {e}")
        return _answer(engine)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraBody):
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, body.lora_name)
        except AdapterRefused as e:
            return _answer(engine, str(e))
        return _answer(engine)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(body: LoraTensorsBody):
        if body.load_format != "safetensors":
            return _answer(
                engine,
                f"load_format {body.load_format!r}: this engine takes load_format "
                "'safetensors' (serialized_named_tensors: [a safetensors file, base64]); it never "
                "unpickles SGLang's default serialized payload",
            )
        if len(body.serialized_named_tensors) != 1:
            return _answer(
                engine, "serialized_named_tensors: give one payload (this engine has one rank)"
            )
        try:
            payload = base64.b64decode(body.serialized_named_tensors[0], validate=True)
            tensors = load_safetensors(payload)
        except (binascii.Error, ValueError, SafetensorError) as e:
            return _answer(engine, f"serialized_named_tensors is not base64 safetensors: {e}")
        try:
            await asyncio.to_thread(
                engine.load_lora_adapter_from_tensors,
                body.lora_name,
                body.config_dict,
                tensors,
                body.upsert,
            )
        except (AdapterRefused, ValueError) as e:
            return _answer(engine, f"cannot load adapter {body.lora_name!r}: {e}")
        return _answer(engine)
