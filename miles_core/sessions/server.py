"""The session server: OpenAI-compatible chat completions per session, token-faithful.

    POST   /sessions                              {rollout_id?, metadata?, routing_key?} → {session_id, base_url}
    GET    /sessions/{id}                         turns, leaves, branches, TITO divergences
    DELETE /sessions/{id}
    POST   /sessions/{id}/v1/chat/completions     OpenAI chat completion (tools, reasoning)
    GET    /sessions/{id}/v1/models
    POST   /sessions/{id}/samples                 {reward?} → one Sample per leaf (JSON)
    GET    /health, /metrics

The server owns tokenization (a TITO family, miles_core/tito): each request's messages attach to
the session's trajectory tree (trajectory.py), only the newly appended messages are tokenized,
and the ids go to the engine's `/generate`; the engine's output ids, log-probs and weight version
are recorded as they are. An agent only needs `base_url = <server>/sessions/<id>/v1`.

Bad input never stops the server: unknown session 404; malformed messages, tool-call arguments
that are not JSON or a conversation longer than the engine's context 400 with the reason; a
generation the engine aborted 503 (nothing recorded); an engine that fails or answers with
something that is not a generate response 502. Sessions idle longer than `--session-ttl-s` are
dropped by a sweep every few seconds (a harness that died without deleting its session does
not hold memory forever).

Bounded against a hostile or broken client: bodies over `MAX_BODY_BYTES` (8 MiB, as the engine's)
are 413 before they are read; more than `--max-sessions` live sessions 429; a turn that would take
a session past `--max-session-ids` stored token ids 413. Bodies are strict JSON (`parse_json`):
NaN/Infinity anywhere (metadata, sampling settings, rewards) and nesting deeper than
`MAX_JSON_DEPTH` are 400, so nothing is stored that cannot be given back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_core.engines.http import ROUTING_KEY_HEADER, error_message, generate_payload
from miles_core.engines.wire import GenerateRequest, GenerateResponse, SamplingParams
from miles_core.processes.auth import bearer, protect
from miles_core.processes.http_limits import MAX_BODY_BYTES, BadJson, BodyLimit, parse_json
from miles_core.processes.managed import KEEP_ALIVE_S
from miles_core.sessions.family_check import check_engine_family
from miles_core.sessions.openai_api import ChatRequest, completion_response
from miles_core.sessions.trajectory import Trajectory
from miles_core.tito import FAMILIES, TitoFamily, build_family
from miles_core.token_fields import declared_field, load_token_fields
from miles_core.types import sample_to_json

MAX_SESSIONS = 4096  # live sessions (a run keeps agent.concurrency of them open)
MAX_SESSION_IDS = 1 << 20  # token ids one session may store over all its turns (≈ 8 MB)


class CreateBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    rollout_id: str | None = None
    metadata: dict[str, Any] = {}
    # behind a router, the sessions that share a key share an engine (e.g. a GRPO group's
    # episodes, whose common prompt its prefix cache then holds once); default: the session id
    # (it travels as an HTTP header: letters, digits and `._:-` only)
    routing_key: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$"
    )


class SamplesBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    reward: float | None = None


@dataclass
class Session:
    id: str
    trajectory: Trajectory
    metadata: dict[str, Any]
    last_used: float = 0.0
    routing_key: str = ""  # the router's key for its turns ("": the session id)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


# `/metrics` totals of the TITO comparison (trajectory.count_mismatches): single-token edits
# between the engine's replies and the re-rendered ones the harness sent back, the replies that
# differed, and the sum of where each first differed (a window's mean = Δsum / Δreplies)
TITO: tuple[tuple[str, Callable[[Trajectory], int]], ...] = (
    ("tito_token_edits", lambda t: t.token_edits),
    ("tito_diverged_replies", lambda t: len(t.divergences)),
    ("tito_first_divergence_sum", lambda t: sum(i for _, i in t.divergences)),
)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    error: dict[str, Any] = {"message": message, "type": kind}
    if code is not None:  # OpenAI's error codes, e.g. context_length_exceeded
        error["code"] = code
    return JSONResponse({"error": error}, status_code=status)


def _json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that reads its body itself (strict JSON), so the
    schema (and a schema fuzzer) still knows it."""
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}}
    return {"requestBody": schema | {"required": False}}


def _validation_message(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    return f"{where}: {first['msg']}".removeprefix(": ")


def create_app(
    engine_url: str,
    family: TitoFamily,
    model_name: str = "miles",
    default_max_tokens: int = 256,
    engine_timeout_s: float = 600.0,
    session_ttl_s: float = 3600.0,
    clock: Callable[[], float] = time.monotonic,
    max_sessions: int = MAX_SESSIONS,
    max_session_ids: int = MAX_SESSION_IDS,
    sweep_s: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    token_budget: int | None = None,
    request_fields: list[str] | None = None,
    lora_path: str | None = None,
) -> FastAPI:
    """`token_budget`: a turn's prompt plus its new tokens at most this many ids (the new
    tokens are capped to what is left; a turn with nothing left answers 400
    `context_length_exceeded`). `session_ttl_s`: a session nobody used for that long (a harness that crashed without
    deleting it) is dropped by the sweep that runs every `sweep_s` (default: a quarter of the
    TTL, at most 30 s) and when a session is created, counted in `expired_sessions`.
    `max_sessions` live sessions (429 past it), `max_session_ids` stored ids per session (413).
    `lora_path`: the LoRA adapter every turn generates with (a LoRA run's)."""
    app = FastAPI(title="miles session server")
    app.add_middleware(BodyLimit, limit=max_body_bytes, respond=_error)
    sweep_every = sweep_s if sweep_s is not None else min(max(session_ttl_s / 4, 0.5), 30.0)
    sweeper: dict[str, asyncio.Task] = {}
    sessions: dict[str, Session] = {}
    counters: Counter = Counter()
    # aiohttp, not httpx: with hundreds of sessions in flight, httpcore's pool re-scans every
    # connection for every queued request, and that scan took a third of this server's CPU
    engine: dict[str, aiohttp.ClientSession] = {}

    def client() -> aiohttp.ClientSession:
        if "session" not in engine:  # created inside the server's event loop
            engine["session"] = aiohttp.ClientSession(
                engine_url,
                connector=aiohttp.TCPConnector(limit=1024),
                timeout=aiohttp.ClientTimeout(total=engine_timeout_s),
                headers=bearer(api_key),  # one key per run: the engine requires it too
            )
        return engine["session"]

    async def _sweep() -> None:
        while True:
            await asyncio.sleep(sweep_every)
            _expire_idle()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper["task"] = asyncio.create_task(_sweep())
        yield
        sweeper.pop("task").cancel()
        if "session" in engine:
            await engine["session"].close()

    app.router.lifespan_context = lifespan

    async def _body(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
        """The request's body as `model`, read as strict JSON (an empty body: the defaults)."""
        try:
            data = parse_json(await request.body())
            return model.model_validate({} if data is None else data)  # no body: the defaults
        except BadJson as e:
            counters["errors_4xx"] += 1
            return _error(400, str(e))
        except ValidationError as e:
            counters["errors_4xx"] += 1
            return _error(400, _validation_message(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        counters["errors_4xx"] += 1
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"] if x != "body")
        return _error(400, f"{where}: {first['msg']}")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        live = sessions.values()  # totals since start: live sessions + deleted ones
        return {
            "sessions": len(sessions),
            **{k: v for k, v in counters.items() if not k.startswith("closed_")},
            "branches": counters["closed_branches"] + sum(s.trajectory.branches for s in live),
            **{k: counters[f"closed_{k}"] + sum(v(s.trajectory) for s in live) for k, v in TITO},
        }

    def _retire(s: Session) -> None:  # its counters join the totals of closed sessions
        counters["closed_branches"] += s.trajectory.branches
        for key, value in TITO:
            counters[f"closed_{key}"] += value(s.trajectory)

    def _expire_idle() -> None:
        now = clock()
        for sid in [k for k, s in sessions.items() if now - s.last_used > session_ttl_s]:
            if not sessions[sid].lock.locked():  # never one with a turn in flight
                _retire(sessions.pop(sid))
                counters["expired_sessions"] += 1

    @app.post("/sessions", status_code=201, openapi_extra=_json_body(CreateBody))
    async def create(request: Request):
        body = await _body(request, CreateBody)
        if isinstance(body, JSONResponse):
            return body
        _expire_idle()
        if len(sessions) >= max_sessions:
            counters["errors_4xx"] += 1
            counters["refused_sessions"] += 1
            return _error(
                429,
                f"{len(sessions)} live sessions, the server's cap (--max-sessions "
                f"{max_sessions}): delete finished sessions or retry later",
                "rate_limit_error",
            )
        sid = uuid.uuid4().hex[:16]
        sessions[sid] = Session(
            sid,
            Trajectory(family, body.rollout_id or sid),
            body.metadata,
            clock(),
            routing_key=body.routing_key or sid,
        )
        counters["sessions_created"] += 1
        return {"session_id": sid, "base_url": f"/sessions/{sid}/v1"}

    def _session(sid: str) -> Session | JSONResponse:
        s = sessions.get(sid)
        if s is None:
            counters["errors_4xx"] += 1
            return _error(404, f"unknown session {sid!r}", "not_found_error")
        s.last_used = clock()
        return s

    @app.get("/sessions/{sid}")
    async def describe(sid: str):
        s = _session(sid)
        if isinstance(s, JSONResponse):
            return s
        t = s.trajectory
        return {
            "session_id": sid,
            "rollout_id": t.rollout_id,
            "metadata": s.metadata,
            "turns": len(t.nodes),
            "leaves": len(t.leaves()),
            "branches": t.branches,
            "tito_token_edits": t.token_edits,
            "tito_divergences": [{"turn": n, "first_divergence": i} for n, i in t.divergences],
        }

    @app.delete("/sessions/{sid}")
    async def delete(sid: str):
        s = sessions.pop(sid, None)
        if s is None:
            counters["errors_4xx"] += 1
            return _error(404, f"unknown session {sid!r}", "not_found_error")
        _retire(s)
        return {"deleted": True}

    @app.get("/sessions/{sid}/v1/models")
    async def models(sid: str):
        s = _session(sid)
        if isinstance(s, JSONResponse):
            return s
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat(sid: str, request: Request):
        s = _session(sid)
        if isinstance(s, JSONResponse):
            return s
        body = await _body(request, ChatRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            messages = body.plain_messages()
        except ValueError as e:
            counters["errors_4xx"] += 1
            return _error(400, str(e))
        async with s.lock:  # one turn at a time per session: the tree stays consistent
            try:
                return await _turn(s, body, messages)
            finally:
                s.last_used = clock()

    async def _turn(s: Session, body: ChatRequest, messages) -> Any:
        t = s.trajectory
        tools = body.tools or None
        try:
            turn = await asyncio.to_thread(t.attach, messages, tools)
            if turn.parent is not None:
                await asyncio.to_thread(t.count_mismatches, turn, messages)
        except Exception as e:  # noqa: BLE001  (a family's renderer refusing the messages, e.g.
            # mistral-common's own exceptions: the request's fault, never the server's)
            counters["errors_4xx"] += 1
            return _error(400, f"cannot render these messages: {e}")
        if t.total_ids + len(turn.ids) > max_session_ids:
            counters["errors_4xx"] += 1
            return _error(
                413,
                f"session {s.id} holds {t.total_ids} token ids; this turn's {len(turn.ids)} "
                f"would pass the cap of {max_session_ids} (--max-session-ids): start a new "
                "session",
            )
        max_new = body.max_completion_tokens or body.max_tokens or default_max_tokens
        if token_budget is not None:
            room = token_budget - len(turn.ids)
            if room < 1:
                counters["errors_4xx"] += 1
                return _error(
                    400,
                    f"this turn's prompt holds {len(turn.ids)} ids: no room left in the "
                    f"session's token budget of {token_budget} (context length)",
                    code="context_length_exceeded",
                )
            max_new = min(max_new, room)
        sampling = SamplingParams(
            max_new_tokens=max_new,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            stop_token_ids=family.stop_ids,
            sampling_seed=body.seed,
        )
        req = GenerateRequest(
            input_ids=turn.ids,
            sampling_params=sampling,
            rid=f"{s.id}-{len(t.nodes)}",
            return_fields=list(request_fields or ()),  # each turn's rows join per turn
            lora_path=lora_path,
        )
        try:
            # behind a router, every turn of the session reaches one engine (its prefix there)
            headers = {ROUTING_KEY_HEADER: s.routing_key}
            async with client().post("/generate", json=generate_payload(req), headers=headers) as r:
                status, data = r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            counters["errors_5xx"] += 1
            return _error(502, f"engine at {engine_url} failed: {e!r}", "engine_error")
        if 400 <= status < 500:
            counters["errors_4xx"] += 1
            return _error(400, f"the engine refused the turn: {error_message(data)}")
        if status != 200:
            counters["errors_5xx"] += 1
            return _error(502, f"engine answered HTTP {status}: {error_message(data)}")
        try:
            out = GenerateResponse.model_validate_json(data)
        except ValidationError as e:
            counters["errors_5xx"] += 1
            return _error(502, f"the engine's reply is not a generate response: {e}"[:500])
        if out.field_error:  # e.g. routed experts of another model: the episode fails on it
            counters["errors_5xx"] += 1
            return _error(502, f"the engine's per-token record was refused: {out.field_error}")
        reason = out.meta_info.finish_reason.type
        if reason == "abort":
            counters["aborted_turns"] += 1
            return _error(503, "the engine aborted this generation (weight update); retry")
        # the message form that renders back to exactly the engine's ids (else plain text)
        reply, how = await asyncio.to_thread(family.parse_exact, out.output_ids, tools)
        if how != "parsed":
            counters[f"replies_{how}"] += 1
        broken = family.broken_tool_call(reply)
        counters["broken_tool_calls"] += broken
        # the prefix this turn shares with its session's previous turn (prompt and reply): what
        # a cache that keeps each session on one engine can reuse, against the engine's hits
        counters["prompt_ids"] += len(turn.ids)
        counters["session_prefix_ids"] += len(turn.parent.ids) if turn.parent is not None else 0
        counters["cached_prompt_ids"] += out.meta_info.cached_tokens
        version = out.meta_info.version
        node = t.record(
            turn,
            messages,
            tools,
            reply,
            out.output_ids,
            out.output_log_probs,
            version,
            reason,
            out.token_fields,
        )
        counters["turns"] += 1
        return completion_response(
            s.id,
            node.id,
            body.model or model_name,
            reply,
            reason,
            len(turn.ids),
            len(out.output_ids),
            version,
            out.output_ids,
            out.meta_info.cached_tokens,
            broken,
        )

    @app.post("/sessions/{sid}/samples", openapi_extra=_json_body(SamplesBody))
    async def samples(sid: str, request: Request):
        s = _session(sid)
        if isinstance(s, JSONResponse):
            return s
        body = await _body(request, SamplesBody)
        if isinstance(body, JSONResponse):
            return body
        reward = body.reward
        async with s.lock:
            out = s.trajectory.samples(reward)
        return {"rollout_id": s.trajectory.rollout_id, "samples": [_sample_json(x) for x in out]}

    # `api_key`: every route but /health (the OpenAI ones too) needs it (processes/auth.py)
    return protect(app, api_key)


def _sample_json(sample) -> dict:
    return sample_to_json(sample)  # token fields as exact bytes


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from miles_core.processes.ports import add_port_arguments, announce, bind_from_args

    ap = argparse.ArgumentParser(prog="miles sessions serve")
    ap.add_argument("--engine-url", required=True, help="the engine (or router) /generate base")
    ap.add_argument(
        "--family",
        default="tiny",
        help=f"TITO family: {', '.join(FAMILIES.names())}, or 'package.module:Class'",
    )
    ap.add_argument(
        "--no-family-check",
        action="store_true",
        help="skip the start-up check that the family tokenizes like the engine's model (for "
        "an engine whose tokenizer cannot be loaded here)",
    )
    add_port_arguments(ap, default_port=30100)
    ap.add_argument("--model-name", default="miles")
    ap.add_argument("--max-tokens", type=int, default=256, help="default max completion tokens")
    ap.add_argument(
        "--session-ttl-s", type=float, default=3600.0, help="drop sessions idle this long"
    )
    ap.add_argument(
        "--max-sessions",
        type=int,
        default=MAX_SESSIONS,
        help="live sessions at most (POST /sessions answers 429 past it)",
    )
    ap.add_argument(
        "--max-session-ids",
        type=int,
        default=MAX_SESSION_IDS,
        help="token ids one session may store over all its turns (413 past it)",
    )
    ap.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="a turn's prompt + new tokens at most this many ids (an episode's token budget)",
    )
    ap.add_argument(
        "--token-field",
        action="append",
        default=[],
        help="a declared per-token field to record (import path pkg.mod:FIELD; repeatable)",
    )
    ap.add_argument(
        "--token-field-json",
        action="append",
        default=[],
        help="a per-token field declared for the run's model, as JSON (TokenField.declaration; "
        "repeatable): what a run passes for the fields it records",
    )
    ap.add_argument(
        "--lora-path",
        default=None,
        metavar="ADAPTER",
        help="the LoRA adapter every turn generates with (the engine's adapter name)",
    )
    args = ap.parse_args(argv)
    if args.token_budget is not None and args.token_budget < 1:
        ap.error("--token-budget must be > 0")
    for flag in ("max_sessions", "max_session_ids", "session_ttl_s"):
        if not getattr(args, flag) > 0:
            ap.error(f"--{flag.replace('_', '-')} must be > 0")
    from miles_core.processes.parent_watch import watch_parent

    watch_parent()  # started by a run: exit with it
    sock = bind_from_args(args, "session server")  # a taken port fails before anything loads
    try:
        fields = load_token_fields(args.token_field)
        fields += [declared_field(raw) for raw in args.token_field_json]
        family = build_family(args.family)
        if not args.no_family_check:  # a wrong family would answer 200 with garbage
            check_engine_family(args.engine_url, family, args.family, api_key=args.api_key)
    except ValueError as e:  # one line saying what to do, no traceback, exit 2
        print(f"miles sessions serve: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    app = create_app(
        args.engine_url,
        family,
        args.model_name,
        args.max_tokens,
        session_ttl_s=args.session_ttl_s,
        max_sessions=args.max_sessions,
        max_session_ids=args.max_session_ids,
        api_key=args.api_key,
        token_budget=args.token_budget,
        # the engine fills the fields it is asked for by their request flags
        request_fields=[f.name for f in fields if f.request_flag],
        lora_path=args.lora_path,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=sock.getsockname()[1],
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    announce(sock, "session server")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    from miles_core.processes.fast_exit import exit_after

    exit_after(main)
