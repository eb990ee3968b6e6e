"""The session server against a real engine server (subprocesses): token-faithful multi-turn
sessions through the official `openai` client, trajectory branching, samples, bad input."""

import json

import httpx
import pytest
from openai import OpenAI
from test_agents import _Server  # imported (and rewritten) at collection

from miles_core.tito import FAMILIES
from tests.plugins.family import HeadersFamily, save_model_dir

PLUGIN = "tests.plugins.family:HeadersFamily"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def servers(session_stack):
    return session_stack


@pytest.fixture
def http(servers):
    with httpx.Client(base_url=servers[1].url, timeout=60) as c:
        yield c


def _session(http) -> str:
    r = http.post("/sessions", json={"metadata": {"task": "t"}})
    assert r.status_code == 201
    return r.json()["session_id"]


def test_a_twenty_turn_session_trains_on_exactly_the_engine_tokens(servers, http):
    sid = _session(http)
    client = OpenAI(base_url=f"{servers[1].url}/sessions/{sid}/v1", api_key="none")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say a"}]
    generated, finish = [], []
    for turn in range(20):
        r = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=6, seed=turn
        )
        generated.append(r.model_extra["miles"]["output_ids"])
        finish.append(r.choices[0].finish_reason)
        reply = r.choices[0].message
        assert r.usage.completion_tokens == len(generated[-1])
        messages.append({"role": "assistant", "content": reply.content or ""})
        if turn % 3 == 2:  # an agent's tool loop: a tool result instead of a user message
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": f"out {turn}"})
        else:
            messages.append({"role": "user", "content": f"turn {turn}"})
    info = http.get(f"/sessions/{sid}").json()
    assert info["turns"] == 20 and info["leaves"] == 1 and info["branches"] == 0
    assert info["tito_token_edits"] == 0 and info["tito_divergences"] == []  # append-only
    data = http.post(f"/sessions/{sid}/samples", json={"reward": 0.5}).json()
    (sample,) = data["samples"]
    prompt = sample["tokens"][: len(sample["tokens"]) - sample["response_length"]]
    response = sample["tokens"][len(prompt) :]
    # loss mask 1 exactly on the engine's tokens, which appear unchanged and in order
    trained = [t for t, m in zip(response, sample["loss_mask"], strict=True) if m]
    assert trained == [t for ids in generated for t in ids]
    assert sum(sample["loss_mask"]) == sum(len(ids) for ids in generated)
    assert len(sample["rollout_log_probs"]) == sample["response_length"]
    assert sample["reward"] == 0.5 and sample["rollout_id"] == data["rollout_id"]
    # and the sequence is what a full render of the conversation gives (tiny is append-only),
    # each cut-off reply closed as a render closes it
    family = FAMILIES.get("tiny")()
    assert prompt == family.prompt(messages[:2], TOOLS)
    closed = sample["tokens"] + (family.stop_ids if finish[-1] == "length" else [])
    assert closed + family.append(messages[-1:], TOOLS) == family.prompt(messages, TOOLS)


def test_a_harness_that_rewrites_history_branches_and_leaves_share_the_rollout(servers, http):
    sid = _session(http)
    url = f"/sessions/{sid}/v1/chat/completions"
    first = [{"role": "user", "content": "list files"}]
    a = http.post(url, json={"messages": first, "max_tokens": 4, "seed": 1}).json()
    reply = a["choices"][0]["message"]
    more = first + [{"role": "assistant", "content": reply["content"] or ""}]
    more += [{"role": "user", "content": "and count them"}]
    http.post(url, json={"messages": more, "max_tokens": 4, "seed": 2}).raise_for_status()
    # compaction: the harness replaces the history with a summary (not append-only)
    compacted = [{"role": "user", "content": "summary: listed files. count them"}]
    http.post(url, json={"messages": compacted, "max_tokens": 4, "seed": 3}).raise_for_status()
    # a retry of the second request: a sibling of the second turn
    http.post(url, json={"messages": more, "max_tokens": 4, "seed": 4}).raise_for_status()
    info = http.get(f"/sessions/{sid}").json()
    assert info["turns"] == 4 and info["branches"] == 1 and info["leaves"] == 3
    samples = http.post(f"/sessions/{sid}/samples", json={}).json()["samples"]
    assert len(samples) == 3 and len({s["rollout_id"] for s in samples}) == 1
    assert all(s["metadata"]["leaves"] == 3 for s in samples)
    long = [s for s in samples if s["metadata"]["turns"] == 2]
    assert len(long) == 2  # the two siblings each carry both turns of their path


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(servers, http):
    sid = _session(http)
    url = f"/sessions/{sid}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/sessions/nope/v1/chat/completions", {"messages": user}, 404, "unknown session"),
        (url, {"messages": []}, 400, "messages"),
        (url, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        (url, {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
        (
            url,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "run", "arguments": "{oops"}}
                        ],
                    },
                    *user,
                ]
            },
            400,
            "not JSON",
        ),
        (url, {"messages": [{"role": "user", "content": "x" * 2100}]}, 400, "context length"),
        (url, {"messages": user, "stream": True}, 400, "stream"),
        (url, {"messages": [*user, {"role": "assistant", "content": "a"}]}, 400, "nothing"),
        (url, {"messages": user, "max_tokens": 0}, 400, "max_tokens"),
    ]
    for path, body, status, words in cases:
        r = http.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], r.text
    r = http.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert http.delete("/sessions/nope").status_code == 404
    ok = http.post(url, json={"messages": user, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get(f"/sessions/{sid}").json()["turns"] == 1  # nothing recorded for bad ones


def test_a_harness_that_disconnects_mid_turn_does_not_stop_the_server(servers, http):
    sid = _session(http)
    url = f"{servers[1].url}/sessions/{sid}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json=body, timeout=0.05)
    r = http.post(url, json={**body, "max_tokens": 3})
    assert r.status_code == 200
    assert http.get("/health").json() == {"status": "ok"}


def test_model_tool_calls_come_back_as_openai_tool_calls(servers, http):
    """The parse path on real server output: a tool-call reply from the family's own ids."""
    family = FAMILIES.get("tiny")()
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": "ls"})},
            }
        ],
    }
    parsed = family.parse(family.completion(call, TOOLS))
    assert parsed["tool_calls"][0]["function"] == call["tool_calls"][0]["function"]


def test_idle_sessions_expire_and_a_garbled_engine_reply_is_a_502():
    """In-process session server (fake clock) in front of a real HTTP "engine" that answers 200
    with a body that is not a generate response."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from miles_core.sessions.server import create_app

    garbled = FastAPI()

    @garbled.post("/generate")
    async def generate():
        return {"text": "hello"}  # no output ids, no meta_info

    now = [0.0]
    with _Server(garbled) as url:
        app = create_app(
            url.removesuffix("/v1"), FAMILIES.get("tiny")(), session_ttl_s=60, clock=lambda: now[0]
        )
        with TestClient(app) as c:
            a = c.post("/sessions").json()["session_id"]
            r = c.post(
                f"/sessions/{a}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 502
            assert "not a generate response" in r.json()["error"]["message"]
            assert c.get(f"/sessions/{a}").json()["turns"] == 0  # nothing recorded
            now[0] = 30.0
            b = c.post("/sessions").json()["session_id"]
            now[0] = 61.0  # a: idle 61 s (past the TTL); b: idle 31 s
            c.post("/sessions")
            assert c.get(f"/sessions/{a}").status_code == 404
            assert c.get(f"/sessions/{b}").status_code == 200
            metrics = c.get("/metrics").json()
            assert metrics["expired_sessions"] == 1 and metrics["sessions"] == 2
            assert metrics["errors_5xx"] == 1


def test_a_reply_sent_back_differently_is_reported_by_where_it_parts_and_its_edits():
    """The engine wrote `{"cmd": "ls"}`; the harness sends the call back as `{"cmd":"ls"}` (the
    same JSON value: the turn extends the session) and its canonical render lacks one space:
    one token edit, first divergence at that space, not every later, shifted position.
    In-process session server in front of a real HTTP "engine" that answers that tool call."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from miles_core.sessions.server import create_app

    family = FAMILIES.get("tiny")()

    def call(arguments: str) -> dict:
        function = {"name": "run", "arguments": arguments}
        return {"id": "call_0", "type": "function", "function": function}

    spaced = {"role": "assistant", "content": "", "tool_calls": [call('{"cmd": "ls"}')]}
    reply = family.completion(spaced)  # <tool_call>\n{"name": "run", "arguments": {"cmd": ...
    scripted = FastAPI()

    @scripted.post("/generate")
    async def generate(body: dict):
        return {
            "text": family.decode(reply),
            "output_ids": reply,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": reply[-1]},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(reply),
                "weight_version": "3",
                "output_token_logprobs": [[-0.5, t, None] for t in reply],
            },
        }

    with _Server(scripted) as url, TestClient(create_app(url.removesuffix("/v1"), family)) as c:
        sid = c.post("/sessions").json()["session_id"]
        chat = f"/sessions/{sid}/v1/chat/completions"
        first = [{"role": "user", "content": "list"}]
        message = c.post(chat, json={"messages": first}).json()["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls"}'
        compact = {"role": "assistant", "content": "", "tool_calls": [call('{"cmd":"ls"}')]}
        tool = {"role": "tool", "tool_call_id": "call_0", "content": "a.txt"}
        c.post(chat, json={"messages": [*first, compact, tool]}).raise_for_status()
        info = c.get(f"/sessions/{sid}").json()
        assert (info["turns"], info["branches"]) == (2, 0)  # the harness extended the session
        assert info["tito_token_edits"] == 1  # a position-wise count said 9
        # <tool_call> \n {"name": "run", "arguments": {"cmd":  then the space: position 38
        assert info["tito_divergences"] == [{"turn": 0, "first_divergence": 38}]
        c.delete(f"/sessions/{sid}")
        metrics = c.get("/metrics").json()  # the totals keep a deleted session's counts
        assert metrics["tito_token_edits"] == 1 and metrics["tito_diverged_replies"] == 1
        assert metrics["tito_first_divergence_sum"] == 38


@pytest.fixture(scope="module")
def headers_engine(tmp_path_factory):
    """An engine server whose model speaks the test tree's family (tests/plugins/family.py)."""
    from miles_core.engines.http import EngineProcess

    logs = tmp_path_factory.mktemp("headers")
    model_dir = save_model_dir(logs / "model", max_positions=2048)
    args = ["--threads", "1", "--max-running", "4"]
    engine = EngineProcess(model_dir, args=args, log_path=logs / "engine.log")
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def test_a_family_from_the_test_tree_serves_a_three_turn_session(headers_engine, tmp_path):
    from miles_core.sessions import SessionServerProcess

    family = HeadersFamily()
    server = SessionServerProcess(headers_engine.url, PLUGIN, log_path=tmp_path / "s.log")
    with server, httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/sessions").json()["session_id"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]
        generated = []
        for turn in range(3):
            r = http.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": messages, "tools": TOOLS, "max_tokens": 6, "seed": turn},
            ).json()
            generated.append(r["miles"]["output_ids"])
            reply = {k: v for k, v in r["choices"][0]["message"].items() if v is not None}
            messages += [{**reply, "content": reply.get("content") or ""}]  # echoed as returned
            messages += [{"role": "tool", "tool_call_id": "call_0", "content": f"out {turn}"}]
        info = http.get(f"/sessions/{sid}").json()
        assert (info["turns"], info["leaves"], info["branches"]) == (3, 1, 0)
        assert info["tito_token_edits"] == 0  # each reply renders back to the engine's ids
        (sample,) = http.post(f"/sessions/{sid}/samples", json={"reward": 1.0}).json()["samples"]
    prompt_length = len(sample["tokens"]) - sample["response_length"]
    assert sample["tokens"][:prompt_length] == family.prompt(messages[:2], TOOLS)
    assert family.decode(sample["tokens"]).startswith("### Tools\n")  # the family's own format
    response = sample["tokens"][prompt_length:]
    trained = [t for t, m in zip(response, sample["loss_mask"], strict=True) if m]
    assert trained == [t for ids in generated for t in ids]
    # the session's ids are the family's render of the conversation (append-only)
    closed = sample["tokens"] + ([] if generated[-1][-1] in family.stop_ids else family.stop_ids)
    assert closed + family.append(messages[-1:], TOOLS) == family.prompt(messages, TOOLS)


def test_a_session_server_that_cannot_serve_its_family_says_why_in_one_line(headers_engine, capsys):
    """Exit 2 with one line saying what to do, and no "listening" line, for: `tiny` in front of
    a model that speaks the headers format (without the check every turn would answer 200 with
    ids of the wrong format), an unknown name, an import path that does not import (the folders
    searched, the PYTHONPATH hint) and a family whose constructor fails (where, not a
    traceback). (The server's `main`, in-process: it exits before serving.)"""
    from miles_core.sessions.server import main

    cases = {
        "tiny": ("--family 'tiny' does not tokenize like", "choose the family of the model's"),
        "gpt2": ("unknown TITO family 'gpt2'",),
        "mypkg.fam:Family": ("no module 'mypkg.fam' in the folders searched", "PYTHONPATH"),
        "tests.plugins.family:BrokenFamily": (
            "could not be built: ",
            "family.py:",  # the constructor's own line
            "RuntimeError: no vocabulary file at /nowhere",
        ),
    }
    for family, expected in cases.items():
        argv = ["--engine-url", headers_engine.url, "--family", family, "--port", "0"]
        with pytest.raises(SystemExit) as refused:
            main(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2, (family, err)
        [line] = err.splitlines()  # no traceback, no "listening" line
        assert line.startswith("miles sessions serve: error: "), line
        assert all(e in line for e in expected), line
