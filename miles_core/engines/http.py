"""Engines behind HTTP: start an engine server as a subprocess, and drive any server that speaks
SGLang's native API (ours or a real `sglang.launch_server`) with the same client.

`HttpEngine.generate` sends requests concurrently (httpx, pooled, bounded by `concurrency`; with
`batch_size` > 1 several per call in SGLang's batch form) while a watchdog polls `/health`; a dead or unreachable engine
raises `EngineUnavailable` naming the URL within a few seconds instead of leaving the rollout
waiting. With a `supervisor` (engines/supervisor.py) the supervisor's heartbeat replaces the
watchdog, and a call the engine's death interrupted is re-issued once on the replacement.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path

import httpx

from miles_core.engines.protocol import SERVER_ROUTES, EngineRequestRejected
from miles_core.engines.supervisor import EngineSupervisor, RoutedSupervision, reissue_once
from miles_core.engines.wire import GenerateRequest, GenerateResponse, version_number
from miles_core.processes.auth import bearer
from miles_core.processes.managed import ManagedProcess, ProcessUnavailable
from miles_core.processes.ports import PortRange
from miles_core.token_fields import token_field

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's session-affinity header


def generate_payload(req: GenerateRequest) -> dict:
    """The `/generate` body in SGLang's field names (checked by tests/contract)."""
    body = {
        "input_ids": req.input_ids,
        "sampling_params": req.sampling_params.model_dump(exclude_none=True),
        "return_logprob": True,
        "rid": req.rid,
    }
    for name in req.return_fields:  # each field by its own request key
        body[token_field(name).request_flag] = True
    if req.lora_path is not None:
        body["lora_path"] = req.lora_path
    body |= scoring_fields(req)
    return body


def _tempered(req: GenerateRequest) -> bool:
    return req.input_logprob_temperature not in (None, 1.0)


def scoring_fields(req: GenerateRequest) -> dict:
    """The prompt-scoring keys of a request that asks: SGLang's `logprob_start_len`, and our
    `input_logprob_temperature` only where it is not 1 (SGLang's fixed value), so a default
    scoring request is SGLang's own."""
    if req.logprob_start_len < 0:
        return {}
    out: dict = {"logprob_start_len": req.logprob_start_len}
    if _tempered(req):
        out["input_logprob_temperature"] = req.input_logprob_temperature
    if req.top_logprobs_num:
        out["top_logprobs_num"] = req.top_logprobs_num
    if req.token_ids_logprob is not None:
        out["token_ids_logprob"] = req.token_ids_logprob
    return out


def batch_payload(requests: list[GenerateRequest]) -> dict:
    """One `/generate` body for several requests (SGLang's batch form: a list per field; engine
    servers take it, sglang-router does not)."""
    body = {
        "input_ids": [r.input_ids for r in requests],
        "sampling_params": [r.sampling_params.model_dump(exclude_none=True) for r in requests],
        "return_logprob": True,
    }
    if all(r.rid is not None for r in requests):
        body["rid"] = [r.rid for r in requests]
    for name in dict.fromkeys(n for r in requests for n in r.return_fields):
        body[token_field(name).request_flag] = [name in r.return_fields for r in requests]
    if any(r.lora_path is not None for r in requests):
        body["lora_path"] = [r.lora_path for r in requests]
    if any(r.logprob_start_len >= 0 for r in requests):
        body["logprob_start_len"] = [r.logprob_start_len for r in requests]
    if any(_tempered(r) for r in requests):
        body["input_logprob_temperature"] = [r.input_logprob_temperature for r in requests]
    if any(r.top_logprobs_num for r in requests):
        body["top_logprobs_num"] = [r.top_logprobs_num for r in requests]
    if any(r.token_ids_logprob is not None for r in requests):
        body["token_ids_logprob"] = [r.token_ids_logprob for r in requests]
    return body


def batches(requests: list[GenerateRequest], size: int) -> list[list[GenerateRequest]]:
    """Consecutive runs of at most `size` requests that share a routing key (one per call)."""
    out: list[list[GenerateRequest]] = []
    for r in requests:
        if out and len(out[-1]) < size and out[-1][0].routing_key == r.routing_key:
            out[-1].append(r)
        else:
            out.append([r])
    return out


EngineUnavailable = ProcessUnavailable  # the engine process died, hangs, or cannot be reached
__all__ = ["EngineProcess", "EngineRequestRejected", "EngineUnavailable", "HttpEngine"]


class EngineProcess(ManagedProcess):
    """One `miles_core.engines.cpu.server` subprocess on 127.0.0.1, stopped by PID. `weight_roots`:
    where its `/update_weights_from_disk` may read (the disk transport's root; none: no disk
    loads)."""

    what = "engine"
    reports_port = True  # binds port 0 (or in `port_range`) itself and reports it

    def __init__(
        self,
        model_dir: str | Path,
        port: int | None = None,
        args: list[str] | None = None,
        log_path: str | Path | None = None,
        port_range: PortRange | str | None = None,
        api_key: str | None = None,
        weight_roots: list[str | Path] | tuple = (),
    ):
        super().__init__(port=port, log_path=log_path, port_range=port_range, api_key=api_key)
        self.model_dir = str(model_dir)
        self.args = args or []
        self.weight_roots = [str(r) for r in weight_roots]

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_core.engines.cpu.server",
            "--model",
            self.model_dir,
            *self.port_args(),
            *self.args,
            *(["--weight-roots", *self.weight_roots] if self.weight_roots else []),
        ]


class HttpEngine:
    """The client side of the engine protocol over HTTP. `weight_routes`: how the server takes
    weights (ours: shared memory, disk, a group; SGLang: disk and a group, see `attach`).
    `api_key`: sent as `Authorization: Bearer` on every call (processes/auth.py)."""

    def __init__(
        self,
        url: str,
        concurrency: int = 64,
        batch_size: int = 1,
        request_timeout: float = 600.0,
        health_interval: float = 1.0,
        health_failures: int = 3,
        weight_routes: frozenset[str] = SERVER_ROUTES,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.headers = bearer(api_key)
        self.weight_routes = frozenset(weight_routes)
        self.per_request_seeds = True  # servers batch continuously: every request is seeded
        self.concurrency = concurrency
        # requests per HTTP call: fewer calls keep the client cheap; 1 for routers, which take
        # only single requests
        self.batch_size = batch_size
        self.request_timeout = request_timeout
        self.health_interval = health_interval
        self.health_failures = health_failures
        # control calls may load a whole model (disk, last broadcast bucket): long reads, fast
        # connection failures
        self._sync = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(300.0, connect=5.0), headers=self.headers
        )
        # the name each adapter is served under, where it is not its own: on a server that
        # cannot replace an adapter in place, its current version (lora/versions.py)
        self.served_adapters: dict[str, str] = {}
        # set by the owner of a supervised engine server: generate calls that die with the
        # engine wait for its replacement and are re-issued once (engines/supervisor.py);
        # control calls still fail fast
        self.supervisor: EngineSupervisor | RoutedSupervision | None = None

    # ------------------------------------------------------------------ data plane
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        return asyncio.run(self.agenerate(requests))

    def async_client(self, max_connections: int | None = None) -> httpx.AsyncClient:
        """The pooled async client `/generate` calls go through (`post_generate`), as an async
        context manager; `max_connections` defaults to `concurrency`."""
        n = max_connections or self.concurrency
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        return httpx.AsyncClient(
            base_url=self.url, timeout=self.request_timeout, limits=limits, headers=self.headers
        )

    async def post_generate(
        self, client: httpx.AsyncClient, chunk: list[GenerateRequest]
    ) -> list[GenerateResponse]:
        """One `/generate` call for `chunk` (one request, or several in SGLang's batch form; one
        routing key): its responses in order. A call the engine's death interrupted waits for
        the supervisor's replacement and is re-issued once (same rids and seeds); a second
        failure raises. Every `/generate` of the runtime goes through here."""
        key = chunk[0].routing_key
        headers = {ROUTING_KEY_HEADER: key} if key else None
        chunk = self.served_requests(chunk)
        body = batch_payload(chunk) if len(chunk) > 1 else generate_payload(chunk[0])

        async def call() -> list[GenerateResponse]:
            try:
                r = await client.post("/generate", json=body, headers=headers)
            except httpx.HTTPError as e:
                raise EngineUnavailable(
                    f"engine at {self.url} failed during /generate: {e!r}"
                ) from e
            return self.parse_responses(r)

        what = "/generate of " + ", ".join(str(r.rid) for r in chunk)
        return await reissue_once(self.supervisor, call, what)

    def served_requests(self, requests: list[GenerateRequest]) -> list[GenerateRequest]:
        """`requests` with each adapter named as this server serves it (`served_adapters`)."""
        served = self.served_adapters
        return [
            r.model_copy(update={"lora_path": served[r.lora_path]}) if r.lora_path in served else r
            for r in requests
        ]

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        # one connection more than the calls in flight: the /health watchdog never waits for a
        # pool slot behind busy /generate calls (it would count that wait as failed checks)
        async with self.async_client(self.concurrency + 1) as client:
            chunks = batches(requests, self.batch_size)
            sem = asyncio.Semaphore(max(1, self.concurrency // self.batch_size))

            async def one(chunk: list[GenerateRequest]) -> list[GenerateResponse]:
                async with sem:
                    return await self.post_generate(client, chunk)

            work = asyncio.gather(*(one(c) for c in chunks))
            # a supervised engine has its own heartbeat, which replaces a dead one
            watch = self._watch(client) if self.supervisor is None else _forever()
            watchdog = asyncio.create_task(watch)
            done, _ = await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if watchdog in done:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                watchdog.result()  # raises EngineUnavailable
            watchdog.cancel()
            return [resp for chunk in work.result() for resp in chunk]

    async def _watch(self, client: httpx.AsyncClient) -> None:
        failures, last = 0, ""
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                r = await client.get("/health", timeout=self.health_interval * 2)
                failures = 0 if r.status_code == 200 else failures + 1
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                failures, last = failures + 1, repr(e)
            if failures >= self.health_failures:
                raise EngineUnavailable(
                    f"engine at {self.url} failed {failures} health checks in a row ({last})"
                )

    def parse_response(self, r: httpx.Response) -> GenerateResponse:
        if 400 <= r.status_code < 500:
            raise EngineRequestRejected(f"engine at {self.url} rejected the request: {_message(r)}")
        if r.status_code != 200:
            raise EngineUnavailable(
                f"engine at {self.url} answered HTTP {r.status_code}: {_message(r)}"
            )
        return GenerateResponse.model_validate(r.json())

    def parse_responses(self, r: httpx.Response) -> list[GenerateResponse]:
        """The answer to a `batch_payload` request, one response per request in order."""
        if r.status_code != 200:
            self.parse_response(r)  # raises the matching error
        data = r.json()
        return [
            GenerateResponse.model_validate(d) for d in (data if isinstance(data, list) else [data])
        ]

    # ------------------------------------------------------------------ control plane
    def post(self, path: str, body: dict | None = None) -> dict:
        """One control call (SGLang's route and body); 4xx raises EngineRequestRejected, an
        unreachable engine EngineUnavailable."""
        try:
            r = self._sync.post(path, json=body or {})
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"engine at {self.url} failed during {path}: {e!r}") from e
        if r.status_code != 200:
            raise EngineRequestRejected(f"{path} on {self.url}: {_message(r)}")
        return r.json() if r.content else {}

    def server_info(self, timeout: float | None = None) -> dict:
        """`/get_server_info`; `timeout` (seconds) instead of the control calls' long read."""
        r = self._sync.get(
            "/get_server_info", timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
        )
        r.raise_for_status()
        return r.json()

    def load_counters(self) -> dict[str, float]:
        """The server's cumulative load counters; {} when it does not report them (SGLang)."""
        try:
            info = self.server_info()
        except httpx.HTTPError:  # e.g. a router in front of the engines
            return {}
        keys = ("steps", "running_sum", "waiting_sum")
        return {k: float(info[k]) for k in keys} if all(k in info for k in keys) else {}

    @property
    def weight_version(self) -> int:
        return version_number(self.server_info()["weight_version"])

    def set_weight_version(self, version: int) -> None:
        self.post(
            "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )

    def pause(self, mode: str = "abort") -> None:
        self.post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self.post("/continue_generation")

    def abort(self, rid: str | None = None) -> None:
        self.post("/abort_request", {"rid": rid or "", "abort_all": rid is None})

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        body: dict = {"model_path": path}
        if version is not None:
            body["weight_version"] = str(version)
        self.post("/update_weights_from_disk", body)

    def update_weights_from_shared_memory(
        self, descriptions: list[str], version: int | None = None, flush_cache: bool = True
    ) -> None:
        body: dict = {
            "serialized_named_tensors": descriptions,
            "load_format": "shared_memory",
            "flush_cache": flush_cache,
        }
        if version is not None:
            body["weight_version"] = str(version)
        self.post("/update_weights_from_tensor", body)

    def weights_checksum(self, scope: str = "all") -> str:
        body = {"action": "checksum"} | ({} if scope == "all" else {"scope": scope})
        return str(self.post("/weights_checker", body)["message"])

    # ------------------------------------------------------------------ LoRA (SGLang's routes)
    def load_lora_adapter(self, name: str, path: str, upsert: bool = False) -> dict:
        body = {"lora_name": name, "lora_path": str(path)} | ({"upsert": True} if upsert else {})
        return self.post("/load_lora_adapter", body)

    def unload_lora_adapter(self, name: str) -> dict:
        return self.post("/unload_lora_adapter", {"lora_name": name})

    def load_lora_adapter_from_tensors(
        self, name: str, config: dict, tensors: dict, upsert: bool = False
    ) -> dict:
        """`tensors`: peft-keyed; sent as a safetensors payload (base64)."""
        from safetensors.torch import save

        payload = save({k: v.detach().contiguous() for k, v in tensors.items()})
        body = {
            "lora_name": name,
            "config_dict": config,
            "serialized_named_tensors": [base64.b64encode(payload).decode()],
            "load_format": "safetensors",
            "upsert": upsert,
        }
        return self.post("/load_lora_adapter_from_tensors", body)

    def lora_adapters(self) -> list[dict]:
        """The loaded adapters (our server's `/get_server_info` lists them)."""
        return list(self.server_info().get("lora_adapters", []))

    def close(self) -> None:
        self._sync.close()


async def _forever() -> None:
    await asyncio.Event().wait()


def _message(r: httpx.Response) -> str:
    return error_message(r.text)


def error_message(body: str) -> str:
    """The reason in an engine's error body (SGLang's `message` or OpenAI's `error.message`)."""
    try:
        data = json.loads(body)
        return str(data.get("message") or data.get("error", {}).get("message") or body)
    except (ValueError, AttributeError):
        return body[:500]
