"""SGLang's router (sglang-router from PyPI) in front of two real engine subprocesses."""

import time

import httpx
import pytest

from miles_core.rollout.http_engine import EngineProcess, HttpEngine
from miles_core.rollout.protocol import GenerateRequest, SamplingParams
from miles_core.rollout.router import RouterProcess

# a router and two engine servers per test: integration, not the inner loop
pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tiny_dir, tmp_path):
    engines = [EngineProcess(tiny_dir, args=["--threads", "1"]).start() for _ in range(2)]
    router = RouterProcess([e.url for e in engines], log_path=tmp_path / "router.log").start()
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
