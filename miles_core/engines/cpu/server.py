"""An HTTP server in front of the serving engine, speaking SGLang's native API.

Field names follow SGLang (`/generate` with `input_ids | text`, `sampling_params`,
`return_logprob`, `rid`; responses with `output_ids` and `meta_info`), so the runtime's client
talks to this server and to a real `sglang.launch_server` the same way. Bad requests get a 4xx
with a message and the server keeps serving.

    python -m miles_core.engines.cpu.server --model DIR --port 30000     (or: miles engine serve ...)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_core.engines.cpu.disk_loads import (
    LOAD_TIMEOUT_S,
    DiskLoader,
    DiskLoadRefused,
    max_load_bytes,
)
from miles_core.engines.cpu.loading import PackedWeightsDiffer
from miles_core.engines.cpu.lora_routes import add_lora_routes
from miles_core.engines.cpu.serving import PAUSE_MODES, ServingEngine
from miles_core.engines.protocol import SERVER_ROUTES
from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams
from miles_core.models.moe import ROUTES
from miles_core.processes.http_limits import (
    MAX_BODY_BYTES,
    BodyLimit,
    add_engine_error_handlers,
    engine_error,
)
from miles_core.processes.managed import KEEP_ALIVE_S
from miles_core.processes.roots import AllowedRoots
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS
from miles_core.weights.checker import mismatched_tensors
from miles_core.weights.receiver import GroupReceiver, ReceiveRefused
from miles_core.weights.shm import read_bucket

log = logging.getLogger("miles.engine")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateBody(_Body):
    extensions: ClassVar[frozenset[str]] = frozenset(
        {"return_token_versions", "input_logprob_temperature"}
    )
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    return_logprob: bool | list[bool] = False
    return_routed_experts: bool | list[bool] = False
    # ours: the weight version of each output token (true on-policy's `token_versions` field)
    return_token_versions: bool | list[bool] = False
    rid: str | list[str] | None = None
    # the LoRA adapter by name, one per prompt in a batch (None: the base model)
    lora_path: str | list[str | None] | None = None
    # scoring of the input ids from this position on (meta_info.input_token_logprobs; -1: none)
    logprob_start_len: int | list[int] = -1
    # ours: the temperature input positions are scored at (default 1, as SGLang)
    input_logprob_temperature: float | list[float | None] | None = None
    # with scoring: each position's n likeliest tokens, and the log-probs of given ids (a list
    # for every prompt, or one list per prompt in the batch form)
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    stream: bool = False


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class PauseBody(_Body):
    mode: str = "abort"


class VersionBody(_Body):
    new_version: str
    abort_all_requests: bool = False


class DiskBody(_Body):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True


class TensorBody(_Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    # ours beyond SGLang's struct (engines/protocol.py: PAUSED_PUSH): pause, load, continue in this call
    pause_mode: str | None = None
    extensions: ClassVar[frozenset[str]] = frozenset({"pause_mode"})


class GroupBody(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class DistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None  # "p2p_shards": trainer ranks send their own shards
    plan: list[dict] | None = None  # p2p: each tensor's pieces per trainer rank (source.py)
    senders: int | None = None  # p2p: trainer ranks in the group
    # engines/protocol.py: PAUSED_PUSH: paused (mode) for the receive, continued after the push's last call
    pause_mode: str | None = None
    # fields of our own beyond SGLang's struct (plan, senders: only read with load_format
    # "p2p_shards")
    extensions: ClassVar[frozenset[str]] = frozenset({"plan", "senders", "pause_mode"})


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"


class MemoryBody(_Body):
    tags: list[str] | None = None


class CheckerBody(_Body):
    action: str = "checksum"
    # ours: what a checksum covers (all, base, adapters)
    scope: str = "all"
    extensions: ClassVar[frozenset[str]] = frozenset({"scope"})


def parse_version(value: str) -> int:
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise EngineRequestError(
            f"unknown weight version {value!r}: versions are integers"
        ) from None
    if version < 0:
        raise EngineRequestError(f"unknown weight version {value!r}: versions are >= 0")
    return version


def tensor_body_refusal(body: TensorBody) -> JSONResponse | None:
    """The 400 for an `/update_weights_from_tensor` body our engine servers do not take (a load
    format other than shared memory, no buckets), or None."""
    if body.load_format != "shared_memory":
        return _error(
            400,
            f"load_format {body.load_format!r} is not supported by this engine; "
            "use 'shared_memory' (buckets in /dev/shm on this host)",
        )
    if not body.serialized_named_tensors:
        return _error(400, "serialized_named_tensors is empty: a push names its buckets")
    return None


def check_pause_mode(mode: str | None) -> None:
    if mode is not None and mode not in PAUSE_MODES:
        raise EngineRequestError(f"unknown pause mode {mode!r}; choose one of {list(PAUSE_MODES)}")


async def _paused_call(engine: ServingEngine, mode: str | None, call, continues: bool):
    """A weight call that carries `pause_mode` (engines/protocol.py: PAUSED_PUSH): the engine pauses
    (mode; `in_place` needs no pause), runs `call`, and continues when `continues` (the push's
    last call) or when the call failed; the call's result either way."""
    if mode is None:
        return await call()
    if mode == "in_place":  # swapped between two decode steps: running requests keep going
        return await call()
    await asyncio.to_thread(engine.pause, mode)
    try:
        result = await call()
    except BaseException:
        engine.resume()
        raise
    if continues or isinstance(result, JSONResponse):  # done, or refused (4xx)
        engine.resume()
    return result


_error = engine_error


def create_app(
    engine: ServingEngine,
    model_path: str = "",
    weight_roots: Sequence[str] | AllowedRoots = (),
    load_timeout_s: float = LOAD_TIMEOUT_S,
) -> FastAPI:
    """`weight_roots`: where `/update_weights_from_disk` may read (none: every disk load is
    refused); `load_timeout_s`: how long one disk load may take (disk_loads.py)."""
    app = FastAPI(title="miles engine", docs_url=None, redoc_url=None)
    snapshot: dict[str, torch.Tensor] = {}
    disk = DiskLoader(weight_roots, timeout_s=load_timeout_s)
    app.state.disk_loader = disk
    add_lora_routes(app, engine, disk.roots)

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    add_engine_error_handlers(app)

    @app.get("/health")
    async def health():
        if not engine.alive():
            return _error(503, "the engine's scheduler has stopped")
        return {}

    @app.get("/health_generate")
    async def health_generate():
        ids = [engine.tokenizer.eos_token_id or 0]
        # a LoRA run's engine takes only requests naming an adapter: one it holds
        held = engine.adapters.loaded if engine.adapters is not None else {}
        req = GenerateRequest(
            input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens=1),
            lora_path=next(iter(held), None)
            if engine.adapters and engine.adapters.required
            else None,
        )
        handle = engine.submit(req)
        try:
            await asyncio.wait_for(_wait(handle), 30)
        except TimeoutError:
            await asyncio.to_thread(engine.abort, handle.rid)
            return _error(503, "the engine did not generate a token within 30 s (paused or stuck)")
        return {}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "weight_version": str(engine.weight_version),
            "weight_routes": sorted(SERVER_ROUTES),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {
            "model_path": model_path,
            "weight_version": str(engine.weight_version),
            "max_running_requests": engine.max_running,
            "context_length": engine.max_context,
            "dtype": engine.dtype,
            "gemm_dtype": str(engine.runner.gemm_dtype).removeprefix("torch."),
            "true_on_policy": engine.true_on_policy,
            "precision": engine.weights.plan.name if engine.weights.plan else "none",
            "lora_adapters": engine.lora_adapters(),
            "device": str(engine.device),
            "paused": engine.paused,
            "prefix_cache_hit_rate": engine.prefix_cache_hit_rate(),
            **engine.load_state(),
            **engine.stats,
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateBody):
        if body.stream:
            return _error(400, "stream=true is not supported by this engine")
        requests = _to_requests(body, engine)
        handles = []
        try:
            for r in requests:
                handles.append(engine.submit(r))
            results = await asyncio.gather(*(_wait(h) for h in handles))
        except BaseException:  # a failed submit, or the client went away: nothing keeps running
            for h in handles:
                if not h.done():
                    await asyncio.to_thread(engine.abort, h.rid)
            raise
        out = [_response_json(r, body) for r in results]
        batched = isinstance(body.text, list) or (
            body.input_ids and isinstance(body.input_ids[0], list)
        )
        # already JSON types: a response object skips FastAPI's jsonable_encoder, which walked
        # every log-prob in Python (12 % of the engine server's GIL time in a fully async run)
        return JSONResponse(out if batched else out[0])

    @app.post("/abort_request")
    async def abort_request(body: AbortBody):
        n = await asyncio.to_thread(engine.abort, None if body.abort_all else body.rid)
        return {"success": True, "message": f"aborted {n} request(s)"}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody):
        if body.mode not in PAUSE_MODES:
            return _error(
                400, f"unknown pause mode {body.mode!r}; choose one of {list(PAUSE_MODES)}"
            )
        await asyncio.to_thread(engine.pause, body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if not await asyncio.to_thread(engine.flush_cache):
            return _error(400, "cannot flush the cache while requests are in flight")
        return {"success": True, "message": "Cache flushed."}

    @app.post("/update_weight_version")
    async def update_weight_version(body: VersionBody):
        version = parse_version(body.new_version)
        if body.abort_all_requests:
            engine.abort()
        engine.set_weight_version(version)
        return {"success": True, "message": "ok", "new_version": str(version)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskBody):
        version = parse_version(body.weight_version) if body.weight_version is not None else None
        try:  # on the loader's own pool, with a timeout: control routes never wait on it
            tensors = await disk.load(
                body.model_path, engine.named_tensors(), engine.weight_version
            )
        except DiskLoadRefused as e:  # outside the roots, missing, corrupt, not the manifest's
            return _error(e.status, str(e))
        try:
            await asyncio.to_thread(
                engine.update_weights_from_tensor, tensors.items(), body.flush_cache
            )
        except (KeyError, ValueError) as e:
            return _error(400, f"weights do not fit this model: {e}")
        if version is not None:
            engine.set_weight_version(version)
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: TensorBody):
        """Same-host push: each item describes a bucket in shared memory (weights/shm.py). All
        buckets are checked before the first copy, so a bad push changes nothing."""
        refused = tensor_body_refusal(body)
        if refused is not None:
            return refused
        version = parse_version(body.weight_version) if body.weight_version is not None else None
        check_pause_mode(body.pause_mode)

        async def load():
            try:
                limit = max_load_bytes(engine.named_tensors())
                buckets = [read_bucket(d, limit) for d in body.serialized_named_tensors]
                tensors = [t for b in buckets for t in b.tensors]
                adopt = bool(buckets) and all(b.adopt for b in buckets)
                await asyncio.to_thread(
                    engine.update_weights_from_tensor, tensors, body.flush_cache, adopt
                )
            except (KeyError, ValueError) as e:
                return _error(400, f"weights do not fit this model: {e}")
            if version is not None:
                engine.set_weight_version(version)
            return {"success": True, "message": f"loaded {len(tensors)} tensors"}

        return await _paused_call(engine, body.pause_mode, load, continues=True)

    receiver = GroupReceiver(
        engine.named_tensors,
        lambda tensors, flush: engine.update_weights_from_tensor(tensors, flush, True),
        device=engine.device,
    )

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: GroupBody):
        """Joins the trainer's weight group (gloo on CPU, nccl on CUDA) as rank `rank_offset`."""
        try:
            await asyncio.to_thread(
                receiver.join,
                body.group_name,
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.backend,
            )
        except ReceiveRefused as e:
            return _error(400, str(e))
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: DistributedBody):
        """One broadcast bucket, or every trainer rank's p2p shards (weights/receiver.py);
        loaded all or nothing by the call that carries `weight_version`."""
        version = parse_version(body.weight_version) if body.weight_version is not None else None
        check_pause_mode(body.pause_mode)

        async def receive():
            try:
                n = await asyncio.to_thread(
                    receiver.receive,
                    body.group_name,
                    body.names,
                    body.dtypes,
                    body.shapes,
                    version is not None,
                    body.flush_cache,
                    body.load_format,
                    body.plan,
                    body.senders,
                )
            except ReceiveRefused as e:
                return _error(400, str(e))
            if version is None:
                return {"success": True, "message": f"staged {n} tensors"}
            engine.set_weight_version(version)
            return {"success": True, "message": f"loaded {n} tensors"}

        return await _paused_call(engine, body.pause_mode, receive, continues=version is not None)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupBody):
        try:
            receiver.leave(body.group_name)
        except ReceiveRefused as e:
            return _error(400, str(e))
        return {"success": True, "message": f"left {body.group_name}"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(body: MemoryBody | None = None):
        try:
            await asyncio.to_thread(engine.release_memory, body.tags if body else None)
        except RuntimeError as e:
            return _error(400, str(e))
        if body is None or not body.tags or "weights" in body.tags:
            receiver.drop_buffers()  # the weight group's kept receive buffers go too
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(body: MemoryBody | None = None):
        await asyncio.to_thread(engine.resume_memory, body.tags if body else None)
        return None

    @app.post("/weights_checker")
    async def weights_checker(body: CheckerBody):
        if body.action == "snapshot":
            snapshot.clear()
            snapshot.update({n: t.clone() for n, t in engine.named_tensors().items()})
            return {"success": True, "message": f"snapshot of {len(snapshot)} tensors"}
        if body.action == "reset_tensors":
            zeros = [(n, torch.zeros_like(t)) for n, t in engine.named_tensors().items()]
            await asyncio.to_thread(engine.update_weights_from_tensor, zeros, False)
            return {"success": True, "message": "tensors reset"}
        if body.action == "compare":
            if not snapshot:
                return _error(400, "no snapshot to compare against; call action=snapshot first")
            bad = mismatched_tensors(snapshot.items(), engine.named_tensors())
            stale = await asyncio.to_thread(engine.runner.verify_packed)
            if bad or stale:  # as SGLang: a failed check is HTTP 400
                return _error(
                    400,
                    f"{len(bad)} tensors differ from the snapshot: {bad[:5]}; "
                    f"packed copies that differ from the tensors: {stale[:5]}",
                )
            return {"success": True, "message": "equal"}
        if body.action == "checksum":  # of what generates: packed copies verified first
            try:
                return {
                    "success": True,
                    "message": await asyncio.to_thread(engine.weights_checksum, body.scope),
                }
            except (PackedWeightsDiffer, ValueError) as e:
                return _error(400, str(e))
        return _error(400, f"unknown weights_checker action {body.action!r}")

    return app


async def _wait(handle):
    """The response of a submitted request, awaited without holding a thread."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(response) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(response))

    handle.add_done_callback(done)
    return await future


def _listify(value, n: int, what: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise EngineRequestError(f"{what} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _refused(e: ValidationError, prefix: str = "") -> EngineRequestError:
    """A request field's validation error as a 400, naming the field."""
    first = e.errors()[0]
    return EngineRequestError(f"{prefix}{'.'.join(map(str, first['loc']))}: {first['msg']}")


def _to_requests(body: GenerateBody, engine: ServingEngine) -> list[GenerateRequest]:
    if (body.input_ids is None) == (body.text is None):
        raise EngineRequestError("give exactly one of input_ids or text")
    if body.input_ids is not None:
        prompts = (
            body.input_ids
            if body.input_ids and isinstance(body.input_ids[0], list)
            else [body.input_ids]
        )
    else:
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    n = len(prompts)
    params = _listify(body.sampling_params, n, "sampling_params")
    if isinstance(body.rid, str) and n > 1:
        raise EngineRequestError(f"give one rid per prompt ({n} prompts), or none")
    rids = _listify(body.rid, n, "rid") if body.rid is not None else [None] * n
    routed = _listify(body.return_routed_experts, n, "return_routed_experts")
    versioned = _listify(body.return_token_versions, n, "return_token_versions")
    adapters = _listify(body.lora_path, n, "lora_path")
    starts = _listify(body.logprob_start_len, n, "logprob_start_len")
    temperatures = _listify(body.input_logprob_temperature, n, "input_logprob_temperature")
    tops = _listify(body.top_logprobs_num, n, "top_logprobs_num")
    asked = body.token_ids_logprob
    per_prompt = isinstance(asked, list) and bool(asked) and not isinstance(asked[0], int)
    token_ids = _listify(asked, n, "token_ids_logprob") if per_prompt else [asked] * n
    out = []
    for ids, sp, rid, want_routes, want_versions, adapter, start, temperature, top, at in zip(
        prompts,
        params,
        rids,
        routed,
        versioned,
        adapters,
        starts,
        temperatures,
        tops,
        token_ids,
        strict=True,
    ):
        try:
            sampling = SamplingParams.model_validate(sp)
        except ValidationError as e:
            raise _refused(e, "sampling_params.") from None
        fields = [ROUTES.name] if want_routes else []  # SGLang's flag for the routes field
        fields += [TOKEN_VERSIONS.name] if want_versions else []
        if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
            raise EngineRequestError(f"input_logprob_temperature must be > 0, got {temperature}")
        try:
            req = GenerateRequest(
                input_ids=ids,
                sampling_params=sampling,
                rid=rid,
                return_fields=fields,
                lora_path=adapter,
                logprob_start_len=start,
                input_logprob_temperature=temperature,
                top_logprobs_num=top,
                token_ids_logprob=at,
            )
        except ValidationError as e:  # a field's own bound (top_logprobs_num >= 0, ...)
            raise _refused(e) from None
        engine.validate(req)
        out.append(req)
    return out


def _response_json(resp, body: GenerateBody) -> dict:
    data = resp.model_dump(mode="json")  # JSON types, converted by pydantic-core
    meta = data["meta_info"]
    for key in SCORING_KEYS:  # only when asked
        if meta.get(key) is None:
            meta.pop(key, None)
    if not body.return_logprob:
        for key in ("output_token_logprobs", *SCORING_KEYS):
            meta.pop(key, None)
    return data


SCORING_KEYS = (
    "input_token_logprobs",
    "input_logprob_temperature",
    "input_top_logprobs",
    "input_token_ids_logprobs",
)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from miles_core.models import load_hf_dir
    from miles_core.processes.auth import protect
    from miles_core.processes.ports import add_port_arguments, announce, bind_from_args

    ap = argparse.ArgumentParser(prog="miles engine serve")
    ap.add_argument("--model", required=True, help="HF model directory")
    add_port_arguments(ap, default_port=30000)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--context-length", type=int, default=None, help="KV cache length (default: the model's)"
    )
    ap.add_argument(
        "--cache-slots", type=int, default=None, help="KV cache slots (default: 2 × max-running)"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="GEMM and residual dtype (bfloat16: faster decode, log-probs within ~1e-2 of fp32)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["auto", "cpu", "cuda"],
        help="where weights and the KV cache live (auto: cuda when available)",
    )
    ap.add_argument(
        "--true-on-policy",
        action="store_true",
        help="generate with the model family's invariant forward and the trainer's log-softmax "
        "(train.true_on_policy: log-probs bitwise the trainer's)",
    )
    ap.add_argument(
        "--precision",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='quantized weights: {"format", "options", "keep_bf16"} (rollout.precision and '
        "precision.keep_bf16); pushes then carry the quantized tensors",
    )
    ap.add_argument(
        "--lora",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='serve LoRA adapters: {"adapters": {name: peft config}, "max_loaded", "required"} '
        "(a LoRA run's engines: its adapters declared, every request naming one)",
    )
    ap.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="serve LoRA adapters, at most this many loaded at once (SGLang's flag)",
    )
    ap.add_argument(
        "--weight-roots",
        nargs="*",
        action="extend",
        default=[],
        metavar="ROOT",
        help="where /update_weights_from_disk may read: absolute directories and fsspec "
        "prefixes (s3://bucket/prefix); none given: every disk load is refused",
    )
    ap.add_argument(
        "--weight-load-timeout",
        type=float,
        default=LOAD_TIMEOUT_S,
        help="seconds one disk load may take before it is answered 408",
    )
    args = ap.parse_args(argv)
    try:  # a malformed root fails the start, before the model loads
        weight_roots = AllowedRoots.parse(args.weight_roots, "weight root")
    except ValueError as e:
        ap.error(f"--weight-roots: {e}")
    if not args.weight_load_timeout > 0:
        ap.error("--weight-load-timeout must be > 0")
    lora = args.lora
    if args.max_loaded_loras is not None:
        if args.max_loaded_loras < 1:
            ap.error("--max-loaded-loras must be at least 1")
        lora = {**(lora or {}), "max_loaded": args.max_loaded_loras}
    from miles_core.processes.parent_watch import watch_parent
    from miles_core.weights.shm import unlink_mapped

    # started by a run: exit with it, and drop the shared-memory weight files its trainer wrote
    watch_parent(on_gone=unlink_mapped)
    # bound (and the port file written) before the model loads: a taken port fails at once
    sock = bind_from_args(args, "engine server")
    port = sock.getsockname()[1]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_hf_dir(args.model)
    engine = ServingEngine(
        model,
        tok,
        seed=args.seed,
        max_running=args.max_running,
        cache_slots=args.cache_slots,
        max_len=args.context_length,
        dtype=args.dtype,
        scheduler="main",
        device=args.device,
        true_on_policy=args.true_on_policy,
        precision=args.precision,
        lora=lora,
    )
    app = create_app(engine, args.model, weight_roots, args.weight_load_timeout)
    app = protect(app, args.api_key)  # every route but /health
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )

    failed: list[BaseException] = []

    def serve() -> None:  # HTTP in a thread, the engine's compute on the main thread
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001  (uvicorn exits with SystemExit)
            failed.append(e)
        finally:
            engine.request_stop()

    def stop(signum, frame) -> None:  # SIGTERM / SIGINT: finish the step, then shut down
        engine.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http = threading.Thread(target=serve, name="http", daemon=True)
    announce(sock, "engine server")  # the model is loaded
    http.start()
    engine.run()
    engine.close()  # in-flight requests get their (aborted) responses before HTTP shuts down
    server.should_exit = True
    http.join(timeout=10)
    if failed or not server.started:
        sys.exit(f"engine server on {args.host}:{port} failed: {failed[0]!r}" if failed else 1)


if __name__ == "__main__":
    import miles_core  # noqa: F401  (env defaults)
    from miles_core.processes.fast_exit import exit_after

    exit_after(main)
