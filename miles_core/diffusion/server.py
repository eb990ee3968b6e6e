"""The image engine server: `ImageEngine` behind HTTP.

    python -m miles_core.diffusion.server --model DIR --port 30000

`POST /rollout/generate` takes a `RolloutRequest` (wire.py, sglang-diffusion's rollout fields)
and answers `RolloutOutput.to_json()`. Weights come as they come to the text engine server,
with SGLang's routes and bodies: shared-memory buckets (`/update_weights_from_tensor`), a
directory under the server's `--weight-roots` (`/update_weights_from_disk`), a version
(`/update_weight_version`), a checksum of what generates (`/weights_checker`). A request the
model cannot take (a word outside its vocabulary, another resolution, zero steps, η < 0) is
answered 400 with the reason; bodies are bounded; the run's key guards every route but
`/health`; the server binds loopback unless told otherwise with a key.

Compute runs on one thread of its own, so rollouts and loads never overlap and the HTTP loop
keeps answering `/health` while a rollout samples.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from miles_core.diffusion.wire import RolloutRequest
from miles_core.engines.cpu.disk_loads import (
    LOAD_TIMEOUT_S,
    DiskLoader,
    DiskLoadRefused,
    max_load_bytes,
)
from miles_core.engines.cpu.server import (
    CheckerBody,
    DiskBody,
    PauseBody,
    TensorBody,
    VersionBody,
    check_pause_mode,
    parse_version,
    tensor_body_refusal,
)
from miles_core.engines.protocol import DISK, PAUSED_PUSH, SHARED_MEMORY, TENSOR
from miles_core.processes.http_limits import (
    MAX_BODY_BYTES,
    BodyLimit,
    add_engine_error_handlers,
    engine_error,
)
from miles_core.processes.roots import AllowedRoots
from miles_core.weights.shm import read_bucket

if TYPE_CHECKING:  # the engine (and diffusers) load after the port is bound
    from miles_core.diffusion.engine import ImageEngine

log = logging.getLogger("miles.image_engine")

# how the server takes weights; a push's pause is the load itself (it waits for the rollout
# in progress), so the transports need no separate pause and continue calls
IMAGE_SERVER_ROUTES = frozenset({SHARED_MEMORY, DISK, PAUSED_PUSH})
# an image run's engines by `rollout.engine`, and the weight routes each takes
IMAGE_ENGINE_ROUTES = {"embedded": frozenset({TENSOR}), "server": IMAGE_SERVER_ROUTES}


def create_app(
    engine: ImageEngine,
    model_path: str = "",
    weight_roots: Sequence[str] | AllowedRoots = (),
    load_timeout_s: float = LOAD_TIMEOUT_S,
) -> FastAPI:
    app = FastAPI(title="miles image engine", docs_url=None, redoc_url=None)
    disk = DiskLoader(weight_roots, timeout_s=load_timeout_s)
    compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="miles-image-compute")
    app.state.compute = compute
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(compute, fn, *args)

    add_engine_error_handlers(app)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": model_path,
            "modality": "image",
            "is_generation": True,
            "image_size": engine.image_size,
            "vocabulary": list(engine.model.vocabulary),
            "weight_version": str(engine.weight_version),
            "weight_routes": sorted(IMAGE_SERVER_ROUTES),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {
            "model_path": model_path,
            "modality": "image",
            "image_size": engine.image_size,
            "weight_version": str(engine.weight_version),
            **engine.stats,
        }

    @app.post("/rollout/generate")
    async def rollout(body: RolloutRequest):
        try:
            out = await run(engine.rollout, body)
        except ValueError as e:  # a word outside the vocabulary, another resolution
            return engine_error(400, str(e))
        return JSONResponse(out.to_json())

    @app.post("/pause_generation")
    async def pause(body: PauseBody):
        check_pause_mode(body.mode)
        engine.pause(body.mode)
        return {"success": True}

    @app.post("/continue_generation")
    async def resume():
        engine.resume()
        return {"success": True}

    @app.post("/update_weight_version")
    async def update_weight_version(body: VersionBody):
        version = parse_version(body.new_version)
        engine.set_weight_version(version)
        return {"success": True, "message": "ok", "new_version": str(version)}

    async def load(tensors, version: int | None):
        try:
            await run(engine.update_weights_from_tensor, tensors)
        except (KeyError, ValueError) as e:
            return engine_error(400, f"weights do not fit this model: {e}")
        if version is not None:
            engine.set_weight_version(version)
        return {"success": True, "message": f"loaded {len(tensors)} tensors"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskBody):
        version = parse_version(body.weight_version) if body.weight_version is not None else None
        try:
            tensors = await disk.load(
                body.model_path, engine.named_tensors(), engine.weight_version
            )
        except DiskLoadRefused as e:  # outside the roots, missing, corrupt, not the manifest's
            return engine_error(e.status, str(e))
        return await load(list(tensors.items()), version)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: TensorBody):
        """Shared-memory buckets (weights/shm.py), all checked before the first copy."""
        refused = tensor_body_refusal(body)
        if refused is not None:
            return refused
        version = parse_version(body.weight_version) if body.weight_version is not None else None
        check_pause_mode(body.pause_mode)
        try:
            limit = max_load_bytes(engine.named_tensors())
            buckets = [read_bucket(d, limit) for d in body.serialized_named_tensors]
        except (KeyError, ValueError) as e:
            return engine_error(400, f"weights do not fit this model: {e}")
        return await load([t for b in buckets for t in b.tensors], version)

    @app.post("/weights_checker")
    async def weights_checker(body: CheckerBody):
        if body.action != "checksum":
            return engine_error(
                400, f"weights_checker action {body.action!r}: this engine answers 'checksum'"
            )
        try:
            return {"success": True, "message": await run(engine.weights_checksum, body.scope)}
        except ValueError as e:
            return engine_error(400, str(e))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        disk.close()
        compute.shutdown(wait=False, cancel_futures=True)

    app.router.lifespan_context = lifespan

    return app


def main(argv: list[str] | None = None) -> None:
    import torch
    import uvicorn

    from miles_core.processes.auth import protect
    from miles_core.processes.managed import KEEP_ALIVE_S
    from miles_core.processes.parent_watch import watch_parent
    from miles_core.processes.ports import add_port_arguments, announce, bind_from_args
    from miles_core.weights.shm import unlink_mapped

    ap = argparse.ArgumentParser(prog="miles image-engine serve")
    ap.add_argument("--model", required=True, help="image model directory (diffusion/model.py)")
    add_port_arguments(ap, default_port=30000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--weight-roots",
        nargs="*",
        action="extend",
        default=[],
        metavar="ROOT",
        help="where /update_weights_from_disk may read; none given: every disk load is refused",
    )
    ap.add_argument("--weight-load-timeout", type=float, default=LOAD_TIMEOUT_S)
    args = ap.parse_args(argv)
    try:
        weight_roots = AllowedRoots.parse(args.weight_roots, "weight root")
    except ValueError as e:
        ap.error(f"--weight-roots: {e}")
    if not args.weight_load_timeout > 0:
        ap.error("--weight-load-timeout must be > 0")
    watch_parent(on_gone=unlink_mapped)  # a run's server exits with it
    sock = bind_from_args(args, "image engine server")
    if args.threads:
        torch.set_num_threads(args.threads)
    from miles_core.diffusion.engine import ImageEngine
    from miles_core.diffusion.model import load_image_model

    engine = ImageEngine(load_image_model(args.model))
    app = create_app(engine, args.model, weight_roots, args.weight_load_timeout)
    app = protect(app, args.api_key)  # every route but /health
    config = uvicorn.Config(
        app, host=args.host, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
    )
    announce(sock, "image engine server")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    import miles_core  # noqa: F401  (env defaults)
    from miles_core.processes.fast_exit import exit_after

    exit_after(main)
