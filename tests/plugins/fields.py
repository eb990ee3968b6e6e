"""Made-up per-token fields, declared once here, and what emits them.

- `PROBE`: a float per response token (`response`-aligned, a JSON list in meta_info), the
  value `token * 0.25 + 0.5` of the token it belongs to; appended session tokens get -1.
- `ROUTES`: an int32 [2, 3] block per input position (`sequence`-aligned, base64 as SGLang sends
  `routed_experts`), a function of the token at that position.

`annotate` adds both to an engine response the way an engine that records them would;
`FieldEngine` wraps an in-process engine, `FieldProxy` sits in front of an engine server (a real
HTTP server on 127.0.0.1 that forwards everything and annotates `/generate` answers).
"""

from __future__ import annotations

import socket
import threading

import httpx
import numpy as np

from miles_core.engines.wire import GenerateRequest, GenerateResponse
from miles_core.token_fields import FIELDS, TokenField

PROBE = TokenField(
    name="probe",
    dtype="float32",
    wire_key="probe_values",
    align="response",
    fill=-1.0,
    pad=-7.0,
)
ROUTES = TokenField(
    name="probe_routes",
    dtype="int32",
    shape=(2, 3),
    encoding="base64",
    align="sequence",
    pad=-1,
)


def declare() -> None:
    FIELDS.register(PROBE.name, PROBE)
    FIELDS.register(ROUTES.name, ROUTES)


def probe_of(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.float32) * 0.25 + 0.5


def routes_of(tokens) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.int32).reshape(-1, 1)
    first = np.concatenate([t, t + 1, t + 2], axis=1)
    second = np.concatenate([t % 5, t % 7, np.full_like(t, 3)], axis=1)
    return np.stack([first, second], axis=1)


def annotate(meta: dict, input_ids: list[int], output_ids: list[int]) -> dict:
    """`meta` with both fields under their wire keys (rows for the tokens of this call)."""
    seen = (list(input_ids) + list(output_ids))[:-1]  # every position the model processed
    return meta | {
        PROBE.wire_key: PROBE.encode(probe_of(output_ids)),
        ROUTES.wire_key: ROUTES.encode(routes_of(seen)),
    }


class FieldEngine:
    """An in-process engine whose responses carry the made-up fields."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        out = []
        for req, resp in zip(requests, self.inner.generate(requests), strict=True):
            data = resp.model_dump()
            data["meta_info"] = annotate(data["meta_info"], req.input_ids, resp.output_ids)
            out.append(GenerateResponse.model_validate(data))
        return out


class FieldProxy:
    """An HTTP proxy in front of an engine server: `/generate` answers get the fields; the
    bodies of `/generate` calls are kept in `requests` (to check rids and seeds)."""

    def __init__(self, upstream: str):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        self.upstream = upstream.rstrip("/")
        self.requests: list[dict] = []

        async def generate(request: Request):
            body = await request.json()
            self.requests.append(body)
            async with httpx.AsyncClient(timeout=300.0) as http:
                r = await http.post(f"{self.upstream}/generate", json=body)
            if r.status_code != 200:
                return Response(r.content, r.status_code, media_type="application/json")
            data = r.json()
            batch = isinstance(data, list)
            inputs = body["input_ids"] if batch else [body["input_ids"]]
            answers = data if batch else [data]
            for ids, answer in zip(inputs, answers, strict=True):
                answer["meta_info"] = annotate(answer["meta_info"], ids, answer["output_ids"])
            return JSONResponse(answers if batch else answers[0])

        async def forward(request: Request):
            path = request.url.path
            async with httpx.AsyncClient(timeout=300.0) as http:
                r = await http.request(
                    request.method, f"{self.upstream}{path}", content=await request.body()
                )
            return Response(r.content, r.status_code, media_type="application/json")

        methods = ["GET", "POST"]
        routes = [
            Route("/generate", generate, methods=["POST"]),
            Route("/{path:path}", forward, methods=methods),
        ]
        self.app = Starlette(routes=routes)
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> FieldProxy:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        httpx.get(f"{self.url}/health", timeout=30.0).raise_for_status()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
