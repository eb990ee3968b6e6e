"""Token authentication (issue 14, item 5): every server of ours takes a key (`--api-key` or
MILES_API_KEY) and then requires `Authorization: Bearer <key>` on every route but /health; a
non-loopback bind without a key is refused at start-up; a run gives its servers a key of its
own and its clients send it (miles_core/processes/auth.py, docs/security.md)."""

import os
import subprocess
import sys

import httpx
import psutil
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai import AuthenticationError, NotFoundError, OpenAI

from miles_core.config import load_config
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.processes.auth import API_KEY_ENV, bearer, is_loopback, protect, run_key

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    """A run's engine fleet (rollout.engine: server) with `network.api_key` set: the engine
    server is a real subprocess that was given the key, and the fleet's client sends it."""
    from miles_core.engines.fleet import EngineFleet

    work = tmp_path_factory.mktemp("auth")
    config = load_config(
        None,
        [
            "model.preset=tiny",
            "rollout.engine=server",
            "rollout.engine_options.threads=1",
            "weight_sync.transport=shared_memory",
            f"network.api_key={KEY}",
            f"checkpoint.root={work}/ckpt",
        ],
    )
    fleet = EngineFleet(config, None, None, tiny_dir, work)
    yield fleet
    fleet.close()
    assert fleet.process.proc.returncode == 0


def test_the_engine_server_requires_the_key_on_every_route_but_health(fleet):
    url = fleet.process.url
    assert httpx.get(f"{url}/health").status_code == 200  # liveness probes carry no key
    for method, path in [
        ("GET", "/get_model_info"),
        ("GET", "/get_server_info"),
        ("POST", "/generate"),
        ("POST", "/pause_generation"),
        ("POST", "/update_weights_from_disk"),
        ("GET", "/no_such_route"),  # 401 before routing: nothing says what exists
    ]:
        missing = httpx.request(method, f"{url}{path}", json={})
        assert missing.status_code == 401, (path, missing.text)
        assert missing.json()["error"]["message"].startswith("missing API key")
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = httpx.request(method, f"{url}{path}", json={}, headers=bearer(KEY + "x"))
        assert wrong.status_code == 401 and "wrong API key" in wrong.json()["message"]
    bare = httpx.get(f"{url}/get_model_info", headers={"Authorization": KEY})
    assert bare.status_code == 401  # the key alone, without the scheme, is not enough
    ok = httpx.get(f"{url}/get_model_info", headers=bearer(KEY))
    assert ok.status_code == 200 and ok.json()["model_path"]
    # the refused /pause_generation never reached the engine
    assert httpx.get(f"{url}/get_server_info", headers=bearer(KEY)).json()["paused"] is None


def test_a_run_with_a_key_generates_and_its_key_is_never_on_a_command_line(fleet, tiny):
    _, tok = tiny
    out = fleet.engine.generate(
        [
            GenerateRequest(
                input_ids=tok.encode("say a"),
                sampling_params=SamplingParams(max_new_tokens=4, sampling_seed=s),
                rid=f"r{s}",
            )
            for s in range(3)
        ]
    )
    assert [len(r.output_ids) for r in out] == [4, 4, 4]
    assert fleet.engine.weight_version == 0  # control calls carry the key too
    assert fleet.api_key == KEY
    child = psutil.Process(fleet.process.pid)
    assert not any(KEY in arg for arg in child.cmdline())  # `ps` shows argv to everyone
    assert child.environ()[API_KEY_ENV] == KEY  # only the owner can read a process's env


def test_the_session_server_takes_the_key_an_openai_client_sends(fleet, tmp_path):
    """A session server with the run's key in front of the keyed engine: its family check and
    its engine calls send the key, and the OpenAI route takes the client's `api_key`."""
    from miles_core.sessions import SessionServerProcess

    with SessionServerProcess(
        fleet.process.url, "tiny", log_path=tmp_path / "s.log", api_key=KEY
    ) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/sessions", json={}).status_code == 401
        r = httpx.post(f"{server.url}/sessions", json={}, headers=bearer(KEY))
        assert r.status_code == 201
        base = f"{server.url}/sessions/{r.json()['session_id']}/v1"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=base, api_key="none", max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "say a"}], max_tokens=2
            )
        reply = OpenAI(base_url=base, api_key=KEY, max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "say a"}], max_tokens=2, seed=1
        )
        # answered: the engine took the session server's key (a 401 there would be a 5xx here)
        assert 1 <= reply.usage.completion_tokens <= 2


def test_the_evaluation_service_requires_the_key():
    from miles_core.eval.service import create_app

    with TestClient(protect(create_app(), KEY)) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/evaluations/x").status_code == 401
        assert c.post("/evaluations", json={}).status_code == 401  # no body is parsed first
        assert c.get("/evaluations/x", headers=bearer(KEY)).status_code == 404


def test_an_openai_client_s_api_key_is_the_bearer_header():
    with TestClient(protect(FastAPI(), KEY)) as http:
        with pytest.raises(AuthenticationError):
            OpenAI(
                base_url="http://testserver/nope/v1", api_key="none", http_client=http
            ).models.list()
        with pytest.raises(NotFoundError):  # past the key: an unknown route is a 404
            OpenAI(
                base_url="http://testserver/nope/v1", api_key=KEY, http_client=http
            ).models.list()


def test_non_loopback_bind_without_a_key_is_refused_at_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    port_file = tmp_path / "port"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_core.sessions.server",
            "--engine-url",
            "http://127.0.0.1:9",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "refusing to serve on 0.0.0.0 without an API key" in done.stderr
    assert API_KEY_ENV in done.stderr
    assert not port_file.exists()  # nothing was bound, nothing served


def test_bind_from_args_refuses_every_non_loopback_host_without_a_key(monkeypatch):
    import argparse

    from miles_core.processes.ports import add_port_arguments, bind_from_args

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    ap = argparse.ArgumentParser()
    add_port_arguments(ap, default_port=0)
    for host in ["0.0.0.0", "::", "10.1.2.3", "example.org"]:
        with pytest.raises(SystemExit, match=f"refusing to serve on {host} without an API key"):
            bind_from_args(ap.parse_args(["--host", host]), "test server")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = ap.parse_args(["--port", "0"])
    with bind_from_args(args, "test server"):
        assert args.api_key == "from-env"  # the variable, when no --api-key is given
    args = ap.parse_args(["--port", "0", "--api-key", "given"])
    with bind_from_args(args, "test server"):
        assert args.api_key == "given"


def test_loopback_hosts_and_the_run_key(monkeypatch):
    assert all(map(is_loopback, ["127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.0.1", "localhost.example"]))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert run_key("configured") == "configured"
    first, second = run_key(), run_key()
    assert first != second and len(first) >= 40  # a fresh random key per run
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert run_key() == "from-env" and run_key("configured") == "configured"


def test_the_config_key_is_checked_and_never_dumped():
    from pydantic import ValidationError

    config = load_config(None, [f"network.api_key={KEY}"])
    assert config.network.api_key == KEY
    assert KEY not in str(config.model_dump(mode="json")) and KEY not in repr(config)
    with pytest.raises(ValidationError, match="network.api_key"):
        load_config(None, ["network.api_key=two words"])


def test_a_managed_child_gets_exactly_its_parent_s_key(monkeypatch):
    from miles_core.processes.managed import ManagedProcess

    monkeypatch.setenv(API_KEY_ENV, "inherited")
    assert API_KEY_ENV not in ManagedProcess(port=1).child_env()  # not an inherited one
    keyed = ManagedProcess(port=1, api_key=KEY)
    assert keyed.child_env()[API_KEY_ENV] == KEY and keyed.headers == bearer(KEY)


@pytest.mark.slow
def test_sglang_router_with_the_key_requires_it_and_sends_it_to_keyed_engines(fleet, tmp_path):
    from miles_core.engines.http import HttpEngine
    from miles_core.engines.router import RouterProcess

    pytest.importorskip("sglang_router")
    # a key starting with "-" is not taken for one of the router's options (engines/router_main.py)
    assert f"-{KEY}" not in " ".join(RouterProcess(["http://x"], api_key=f"-{KEY}").command())
    with RouterProcess([fleet.process.url], log_path=tmp_path / "r.log", api_key=KEY) as router:
        assert router.healthy_urls() == [fleet.process.url]  # our /workers calls send the key
        # `ps` shows argv to everyone (the router retitles itself once running; its key was
        # never in its arguments, not even before)
        assert not any(KEY in arg for arg in psutil.Process(router.pid).cmdline())
        assert not any(KEY in arg for arg in router.command())
        assert httpx.get(f"{router.url}/workers").status_code == 401
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{router.url}/generate", json=body).status_code == 401
        client = HttpEngine(router.url, api_key=KEY)
        try:
            request = GenerateRequest(
                input_ids=[5, 6], sampling_params=SamplingParams(max_new_tokens=2)
            )
            # through the router to the keyed engine: the router sends the key to its workers
            assert len(client.generate([request])[0].output_ids) == 2
        finally:
            client.close()


@pytest.mark.slow
def test_a_run_keyed_from_the_environment_trains_and_pushes_its_weights(tmp_path, monkeypatch):
    """A whole step (rollout, train, shared-memory push) of a run whose key comes from
    MILES_API_KEY; its engine server refuses a client without it."""
    from miles_core.run.runtime import RLRuntime, prepare_model_dir

    monkeypatch.setenv(API_KEY_ENV, KEY)
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=4",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.threads=1",
            "rollout.engine=server",
            "rollout.engine_options.threads=1",
            "weight_sync.transport=shared_memory",
            f"checkpoint.root={tmp_path}/ckpt",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, tmp_path), None)
    try:
        url = rt.fleet.process.url
        assert httpx.get(f"{url}/get_model_info").status_code == 401
        rt.train(rt.rollout(0))
        rt.update_weights()
        assert rt.fleet.engine.weight_version == 1  # the push's control calls carried the key
    finally:
        rt.close()
