"""The session server against a hostile or broken client (issue 14): bodies over 8 MiB, more
sessions than the cap, a session past its stored-ids cap, expiry on a timer, non-finite numbers
and deep nesting anywhere in a body. In-process server (the properties are the app's) in front
of a real HTTP "engine" on 127.0.0.1 that answers every turn with the same five ids."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from miles_core.processes.http_limits import BadJson, parse_json
from miles_core.sessions.server import create_app
from miles_core.tito import FAMILIES
from tests.servers import served

FAMILY = FAMILIES.get("tiny")()
REPLY = FAMILY.completion({"role": "assistant", "content": "abcdefgh"})[:5]
USER = [{"role": "user", "content": "hi"}]


def _engine_app() -> FastAPI:
    app = FastAPI()
    app.state.calls = 0

    @app.post("/generate")
    async def generate(body: dict):
        app.state.calls += 1
        return {
            "text": FAMILY.decode(REPLY),
            "output_ids": REPLY,
            "meta_info": {
                "finish_reason": {"type": "length", "length": len(REPLY)},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(REPLY),
                "weight_version": "1",
                "output_token_logprobs": [[-0.5, t, None] for t in REPLY],
            },
        }

    return app


@pytest.fixture(scope="module")
def engine():
    """(url, app) of the scripted engine, served in a thread (tests/servers.py)."""
    app = _engine_app()
    with served(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine[0], FAMILY)) as c:
        yield c


def _chat(sid: str) -> str:
    return f"/sessions/{sid}/v1/chat/completions"


def _raw(c: TestClient, path: str, body: str | bytes):
    return c.post(path, content=body, headers={"content-type": "application/json"})


def test_bodies_over_8_mib_are_413_before_they_are_read_declared_or_chunked(client):
    sid = client.post("/sessions").json()["session_id"]
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (9 << 20)}]}).encode()
    r = _raw(client, _chat(sid), big)  # declares its Content-Length
    assert r.status_code == 413 and "exceeds the limit of 8388608 bytes" in r.text, r.text

    def chunks():  # no Content-Length: read until past the limit, then refused
        for _ in range(10):
            yield b"x" * (1 << 20)

    r = client.post(_chat(sid), content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "a request body exceeds" in r.json()["error"]["message"]
    assert client.get(f"/sessions/{sid}").json()["turns"] == 0
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "route, body",
    [
        ("create", '{"metadata": {"a": NaN}}'),
        ("create", '{"metadata": {"a": [1, {"b": Infinity}]}}'),
        ("create", '{"metadata": {"a": -Infinity}}'),
        ("create", '{"metadata": {"a": 1e999}}'),
        ("samples", '{"reward": NaN}'),
        ("samples", '{"reward": Infinity}'),
        ("samples", '{"reward": -1e400}'),
        ("chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        ("chat", '{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
    ],
)
def test_non_finite_numbers_anywhere_are_400_and_nothing_is_stored(client, engine, route, body):
    """Before: `metadata: {"a": NaN}` was stored and every later GET of the session was a 500;
    a NaN reward made /samples a 500."""
    sid = client.post("/sessions", json={"metadata": {"ok": 1}}).json()["session_id"]
    path = {"create": "/sessions", "samples": f"/sessions/{sid}/samples", "chat": _chat(sid)}
    before = client.get("/metrics").json()["sessions"]
    calls = engine[1].state.calls
    r = _raw(client, path[route], body)
    assert r.status_code == 400, r.text
    assert "finite" in r.json()["error"]["message"]
    assert client.get("/metrics").json()["sessions"] == before  # no session was created
    assert engine[1].state.calls == calls  # nothing reached the engine
    info = client.get(f"/sessions/{sid}")
    assert info.status_code == 200 and info.json()["metadata"] == {"ok": 1}
    assert client.post(f"/sessions/{sid}/samples", json={"reward": 1.0}).status_code == 200


@pytest.mark.parametrize("route", ["create", "samples", "chat"])
def test_50k_deep_json_is_400_on_every_route(client, route):
    sid = client.post("/sessions").json()["session_id"]
    path = {"create": "/sessions", "samples": f"/sessions/{sid}/samples", "chat": _chat(sid)}
    deep = '{"metadata": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}"
    r = _raw(client, path[route], deep)
    assert r.status_code == 400 and "nests deeper than 64 levels" in r.text, r.text
    assert client.get("/health").status_code == 200


def test_50k_deep_tool_call_arguments_are_400(client):
    """The arguments are a string inside the body (not nesting of the body itself) that the
    server parses as JSON too."""
    sid = client.post("/sessions").json()["session_id"]
    call = {"id": "c", "function": {"name": "run", "arguments": "[" * 50_000 + "]" * 50_000}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    r = client.post(_chat(sid), json={"messages": [*USER, assistant, *USER]})
    assert r.status_code == 400, r.text
    assert "tool-call arguments nests deeper than 64" in r.json()["error"]["message"]


def test_brackets_and_escaped_quotes_inside_strings_do_not_count_as_nesting(client):
    sid = client.post("/sessions").json()["session_id"]
    content = '\\"[' * 100 + "{" * 100  # quotes escaped inside the string, 200 brackets
    body = '{"messages": [{"role": "user", "content": "' + content + '"}], "max_tokens": 5}'
    r = _raw(client, _chat(sid), body)
    assert r.status_code == 200, r.text
    assert r.json()["miles"]["output_ids"] == REPLY


def test_strict_json_reader_refuses_what_it_cannot_give_back():
    assert parse_json(b'{"a": [1, 2.5, "NaN", {"b": null}]}') == {"a": [1, 2.5, "NaN", {"b": None}]}
    assert parse_json(b"  ", empty={}) == {}
    assert parse_json("[" * 64 + "]" * 64) is not None  # exactly the limit
    for bad, words in [
        (b"[NaN]", "holds NaN, not a JSON number"),
        (b'{"x": -Infinity}', "holds -Infinity, not a JSON number"),
        (b"[1e309]", "out of range"),
        (b"[" * 65 + b"]" * 65, "nests deeper than 64"),
        (b"{not json", "not JSON"),
        (b"[" + b"9" * 5000 + b"]", "not acceptable JSON"),
        (b"\xff\xfe", "not"),
    ]:
        with pytest.raises(BadJson, match=words):
            parse_json(bad)


def test_a_seed_out_of_the_engines_range_is_400_not_a_500(client, engine):
    sid = client.post("/sessions").json()["session_id"]
    calls = engine[1].state.calls
    for seed in (1 << 64, -(1 << 63) - 1):
        r = client.post(_chat(sid), json={"messages": USER, "seed": seed})
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"], r.text
    assert engine[1].state.calls == calls


def test_live_sessions_are_capped_with_429_and_a_session_s_ids_with_413(engine):
    prompt = len(FAMILY.prompt(USER))
    # the first turn stores prompt + reply ids; a second branch needs `prompt` more
    cap = 2 * prompt + len(REPLY) - 1
    app = create_app(engine[0], FAMILY, max_sessions=2, max_session_ids=cap)
    with TestClient(app) as c:
        a = c.post("/sessions").json()["session_id"]
        c.post("/sessions").raise_for_status()
        r = c.post("/sessions")
        assert r.status_code == 429 and "--max-sessions 2" in r.json()["error"]["message"]
        assert c.get("/metrics").json()["refused_sessions"] == 1
        assert c.post(_chat(a), json={"messages": USER, "max_tokens": 5}).status_code == 200
        # the same opening again: nothing to extend, a new branch of `prompt` ids
        r = c.post(_chat(a), json={"messages": USER, "max_tokens": 5})
        assert r.status_code == 413, r.text
        assert f"would pass the cap of {cap}" in r.json()["error"]["message"]
        assert c.get(f"/sessions/{a}").json()["turns"] == 1  # nothing recorded
        c.delete(f"/sessions/{a}").raise_for_status()
        assert c.post("/sessions").status_code == 201  # room again


def test_idle_sessions_expire_on_the_sweep_timer_without_any_new_session():
    """Before: expiry ran only inside POST /sessions, so a server nobody opened sessions on
    kept every abandoned one."""
    now = [0.0]
    app = create_app(
        "http://127.0.0.1:9", FAMILY, session_ttl_s=60, clock=lambda: now[0], sweep_s=0.01
    )
    with TestClient(app) as c:
        sid = c.post("/sessions").json()["session_id"]
        now[0] = 61.0  # idle past the TTL; from here on, only GET /metrics is called
        deadline = time.monotonic() + 10
        while c.get("/metrics").json().get("expired_sessions", 0) == 0:
            assert time.monotonic() < deadline, "the sweep never ran"
            threading.Event().wait(0.01)
        assert c.get(f"/sessions/{sid}").status_code == 404
