"""SGLang's router (sglang-router from PyPI) in front of two real engine subprocesses."""

import time

import httpx
import pytest

from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.engines.router import RouterProcess
from miles_core.engines.wire import GenerateRequest, SamplingParams

# a router and two engine servers per test: integration, not the inner loop
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    """One router over two engines for the module; the test that kills an engine runs last."""
    engines = [EngineProcess(tiny_dir, args=["--threads", "1"]).start() for _ in range(2)]
    logs = tmp_path_factory.mktemp("router")
    router = RouterProcess([e.url for e in engines], log_path=logs / "router.log").start()
    yield router, engines
    router.stop()
    for e in engines:
        e.stop()
    assert router.proc.poll() is not None and all(e.proc.poll() is not None for e in engines)


def _served(engines) -> list[int]:
    return [int(httpx.get(f"{e.url}/get_server_info").json()["prompt_tokens"]) for e in engines]


def _send(client, key: str, n: int = 1) -> None:
    client.generate(
        [
            GenerateRequest(
                input_ids=[5, 6, 7],
                routing_key=key,
                sampling_params=SamplingParams(max_new_tokens=1),
            )
            for _ in range(n)
        ]
    )


def test_requests_with_the_same_key_land_on_the_same_engine(fleet):
    router, engines = fleet
    client = HttpEngine(router.url)
    owner = {}
    for key in ["session-a", "session-b", "session-c", "session-d"]:
        before = _served(engines)
        _send(client, key, n=3)
        after = _served(engines)
        moved = [i for i in range(2) if after[i] != before[i]]
        assert len(moved) == 1, f"{key} was split across engines: {before} -> {after}"
        owner[key] = moved[0]
    for key, engine_index in owner.items():  # and they stay there
        before = _served(engines)
        _send(client, key)
        assert [i for i in range(2) if _served(engines)[i] != before[i]] == [engine_index]
    client.close()


def test_the_router_listens_on_loopback_only(fleet):
    """Its API and its Prometheus exporter (whose default is 0.0.0.0:29000)."""
    import psutil

    router, _ = fleet
    proc = psutil.Process(router.pid)
    listening = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert {a.port for a in listening} >= {router.port, router.metrics_port}
    assert all(a.ip == "127.0.0.1" for a in listening), listening


def test_an_agent_session_keeps_its_engine_and_its_prefix_cache(fleet, tmp_path):
    """The session server in front of the router sends each session's routing key (its id, or
    the key it was opened with: a GRPO group's) with every turn: every turn after a session's
    first reaches the engine that served the first, so the engine finds the whole earlier
    conversation in its prefix cache (with 2 engines and no affinity, each of these 12 turns
    would miss with probability 1/2)."""
    from openai import OpenAI

    from miles_core.sessions import SessionServerProcess

    router, _ = fleet
    sessions = SessionServerProcess(router.url, "tiny", log_path=tmp_path / "s.log").start()
    try:
        for n in range(4):
            sid = httpx.post(f"{sessions.url}/sessions", json={}).json()["session_id"]
            client = OpenAI(base_url=f"{sessions.url}/sessions/{sid}/v1", api_key="none")
            messages = [{"role": "user", "content": f"say a {n}"}]
            seen = 0  # ids of the conversation so far: the prompt and reply of the last turn
            for turn in range(4):
                r = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=4, seed=turn
                )
                if turn:
                    assert r.usage.prompt_tokens_details.cached_tokens >= seen, (n, turn)
                seen = r.usage.prompt_tokens + r.usage.completion_tokens - 1
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": "more"},
                ]
            client.close()
        totals = httpx.get(f"{sessions.url}/metrics").json()  # the same, as the run sees it
        assert totals["cached_prompt_ids"] >= totals["session_prefix_ids"] > 0
        # sessions that share a routing key (a GRPO group's episodes) share an engine: the
        # second's first turn finds the first's prompt in that engine's cache (by session id,
        # it would reach the other engine with probability 1/2 per group)
        for g in range(3):
            usage = []
            for _ in range(2):
                body = {"routing_key": f"s0-g{g}"}
                sid = httpx.post(f"{sessions.url}/sessions", json=body).json()["session_id"]
                client = OpenAI(base_url=f"{sessions.url}/sessions/{sid}/v1", api_key="none")
                messages = [{"role": "user", "content": f"reverse group {g}"}]
                r = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=4, seed=0
                )
                usage.append(r.usage)
                client.close()
            assert usage[1].prompt_tokens_details.cached_tokens >= usage[1].prompt_tokens - 1, g
        for bad in ("", "k" * 129, 7, "a\r\nX-Injected: 1", "ü"):
            r = httpx.post(f"{sessions.url}/sessions", json={"routing_key": bad})
            assert 400 <= r.status_code < 500, bad
    finally:
        sessions.stop()


def test_a_dead_engine_leaves_rotation_and_is_readmitted_only_at_the_current_version(
    fleet, tiny_dir
):
    router, engines = fleet
    client = HttpEngine(router.url)
    engines[0].proc.kill()
    t0 = time.monotonic()
    while engines[0].url in router.healthy_urls():
        assert time.monotonic() - t0 < 10, "the router did not notice the dead engine within 10 s"
        time.sleep(0.1)
    before = _served(engines[1:])
    _send(client, "any-key", n=4)  # every request now goes to the live engine
    assert _served(engines[1:])[0] == before[0] + 12

    # a replacement engine starts at version 0 while the fleet is at version 2: quarantined
    router.remove_worker(engines[0].url)
    replacement = EngineProcess(tiny_dir, args=["--threads", "1"]).start()
    try:
        assert not router.readmit_if_current(replacement.url, version=2)
        assert replacement.url not in router.healthy_urls()
        HttpEngine(replacement.url).set_weight_version(2)
        assert router.readmit_if_current(replacement.url, version=2)
        assert replacement.url in router.healthy_urls()
    finally:
        replacement.stop()
    client.close()
