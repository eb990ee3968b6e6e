"""The session server against a real engine server (subprocesses): token-faithful multi-turn
sessions through the official `openai` client, trajectory branching, samples, bad input."""

import json

import httpx
import pytest
from openai import OpenAI

from miles_core.tito import get_family

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
    assert info["mismatched_tokens"] == 0  # an append-only harness
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
    family = get_family("tiny")
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
    family = get_family("tiny")
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
    from test_agents import _Server

    from miles_core.sessions.server import create_app

    garbled = FastAPI()

    @garbled.post("/generate")
    async def generate():
        return {"text": "hello"}  # no output ids, no meta_info

    now = [0.0]
    with _Server(garbled) as url:
        app = create_app(
            url.removesuffix("/v1"), get_family("tiny"), session_ttl_s=60, clock=lambda: now[0]
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
