"""The engine behind its HTTP server, as a real subprocess on 127.0.0.1."""

import copy
import json
import threading
import time

import httpx
import pytest
import torch

from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.http import (
    EngineProcess,
    EngineRequestRejected,
    EngineUnavailable,
    HttpEngine,
)
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.rollout.rollout_fn import encode_prompt


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    proc = EngineProcess(
        tiny_dir,
        args=["--threads", "1"],
        log_path=tmp_path_factory.mktemp("engine") / "log.txt",
        weight_roots=[tiny_dir],  # disk loads from the model dir only
    )
    proc.start()
    yield proc
    proc.stop()
    assert proc.proc.returncode == 0  # SIGTERM by PID: the step finishes, then a clean exit


@pytest.fixture
def client(server):
    c = HttpEngine(server.url)
    yield c
    c.close()


def _req(tok, text, rid=None, **sp):
    return GenerateRequest(
        input_ids=encode_prompt(tok, text), sampling_params=SamplingParams(**sp), rid=rid
    )


def test_server_logprobs_equal_in_process_logprobs(client, tiny):
    model, tok = tiny
    reqs = [
        _req(tok, t, max_new_tokens=12, sampling_seed=7 + i)
        for i, t in enumerate(["say a", "reverse abcd", "12+3="])
    ]
    over_http = client.generate(reqs)
    local = ServingEngine(copy.deepcopy(model), tok)
    in_process = local.generate(reqs)
    local.close()
    for h, p in zip(over_http, in_process, strict=True):
        assert h.output_ids == p.output_ids
        assert torch.allclose(
            torch.tensor(h.output_log_probs), torch.tensor(p.output_log_probs), atol=1e-5, rtol=0
        )
        assert h.meta_info.weight_version == "0"


def test_text_input_and_batched_input_ids(server, tiny):
    _, tok = tiny
    r = httpx.post(
        f"{server.url}/generate", json={"text": "say a", "sampling_params": {"max_new_tokens": 3}}
    )
    assert (
        r.status_code == 200
        and len(r.json()["output_ids"]) == 3
        and "output_token_logprobs" not in r.json()["meta_info"]
    )
    ids = encode_prompt(tok, "go")
    r = httpx.post(
        f"{server.url}/generate",
        json={
            "input_ids": [ids, ids],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
        },
    )
    body = r.json()
    assert isinstance(body, list) and len(body) == 2
    assert [len(x["meta_info"]["output_token_logprobs"]) for x in body] == [2, 2]


def test_abort_one_request_over_http(client, server, tiny):
    _, tok = tiny
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=client.generate([_req(tok, "say a", rid="long-1", max_new_tokens=450)])[0]
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while client.server_info()["running"] < 1:  # wait until the request is in the engine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    httpx.post(f"{server.url}/abort_request", json={"rid": "long-1"}).raise_for_status()
    t.join(30)
    assert out["r"].meta_info.finish_reason.type == "abort" and len(out["r"].output_ids) < 450


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_over_http(client, tiny, mode):
    _, tok = tiny
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=client.generate([_req(tok, "reverse abc", max_new_tokens=400)])[0]
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while client.server_info()["running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.pause(mode)
    try:
        info = client.server_info()
        assert info["paused"] == mode
        if mode == "retract":
            assert info["running"] == 0 and info["waiting"] == 1
        client.set_weight_version(5)  # a weight-version change while paused
    finally:
        client.resume()
    t.join(60)
    r = out["r"]
    if mode == "abort":
        assert r.meta_info.finish_reason.type == "abort"
    else:  # nothing lost: the request ran to its full length after the pause
        assert len(r.output_ids) == 400 and r.meta_info.finish_reason.type == "length"
        assert r.meta_info.weight_version == "5"
    client.set_weight_version(0)


@pytest.mark.parametrize(
    "payload, message",
    [
        (
            {"input_ids": [1, 2, 99999], "sampling_params": {"max_new_tokens": 2}},
            "outside the vocabulary",
        ),
        (
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -3}},
            "max_new_tokens must be >= 0",
        ),
        (
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**9}},
            "exceeds the context length",
        ),
        (
            {"input_ids": [5] * 600, "sampling_params": {"max_new_tokens": 1}},
            "exceeds the context length",
        ),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": "abc"}, "invalid request"),
        ({}, "exactly one of input_ids or text"),
    ],
)
def test_bad_generate_requests_get_400_and_the_server_keeps_serving(server, payload, message):
    r = httpx.post(f"{server.url}/generate", json=payload)
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]
    ok = httpx.post(
        f"{server.url}/generate",
        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
    )
    assert ok.status_code == 200


def test_malformed_json_unknown_version_and_oversize_body(server):
    r = httpx.post(
        f"{server.url}/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "invalid request" in r.json()["message"]
    r = httpx.post(f"{server.url}/update_weight_version", json={"new_version": "v-latest"})
    assert r.status_code == 400 and "unknown weight version 'v-latest'" in r.json()["message"]
    big = json.dumps({"input_ids": [5] * (3 << 20)}).encode()
    r = httpx.post(
        f"{server.url}/generate", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "exceeds the limit" in r.json()["message"]

    def chunks():  # chunked transfer: no Content-Length to trust
        yield b'{"input_ids": ['
        for _ in range(5 << 10):  # 10 MiB > the 8 MiB limit
            yield b"5," * 1024
        yield b"5]}"

    r = httpx.post(
        f"{server.url}/generate", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "exceeds the limit" in r.json()["message"]
    r = httpx.post(f"{server.url}/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "unknown pause mode" in r.json()["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_client_raises_a_clear_error_for_rejected_requests(client):
    with pytest.raises(EngineRequestRejected, match="outside the vocabulary"):
        client.generate([GenerateRequest(input_ids=[99999])])


def test_weights_checker_and_update_from_disk(server, client, tiny_dir):
    httpx.post(f"{server.url}/weights_checker", json={"action": "snapshot"}).raise_for_status()
    assert httpx.post(f"{server.url}/weights_checker", json={"action": "compare"}).json()["success"]
    httpx.post(f"{server.url}/weights_checker", json={"action": "reset_tensors"}).raise_for_status()
    failed = httpx.post(f"{server.url}/weights_checker", json={"action": "compare"})
    assert (
        failed.status_code == 400 and "tensors differ from the snapshot" in failed.json()["message"]
    )
    client.update_weights_from_disk(str(tiny_dir), version=3)
    assert httpx.post(f"{server.url}/weights_checker", json={"action": "compare"}).json()["success"]
    assert client.weight_version == 3
    client.set_weight_version(0)
    with pytest.raises(EngineRequestRejected, match="no safetensors"):
        client.update_weights_from_disk("/nonexistent/dir")


def test_a_killed_engine_is_noticed_within_10_seconds(tiny_dir, tiny):
    _, tok = tiny
    with EngineProcess(tiny_dir, args=["--threads", "1"]) as proc:
        client = HttpEngine(proc.url)
        errors = {}

        def run():
            try:
                client.generate([_req(tok, "say a", max_new_tokens=450) for _ in range(200)])
            except Exception as e:  # noqa: BLE001
                errors["e"] = e
                errors["t"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while client.server_info()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        killed_at = time.monotonic()
        proc.proc.kill()
        t.join(30)
        assert isinstance(errors.get("e"), EngineUnavailable)
        assert proc.url in str(errors["e"])
        assert errors["t"] - killed_at < 10
        with pytest.raises(EngineUnavailable, match=proc.url):
            client.generate([_req(tok, "say a", max_new_tokens=2)])
        client.close()


def test_many_requests_in_flight_do_not_block_control_calls(client, tiny):
    """Waiting /generate calls hold no worker threads, so pause → version → continue go through
    with more requests in flight than the server's thread pool has threads."""
    _, tok = tiny
    out = {}
    reqs = [_req(tok, f"say a {i}", max_new_tokens=300) for i in range(24)]
    t = threading.Thread(
        target=lambda: out.update(r=HttpEngine(client.url, concurrency=24).generate(reqs))
    )
    t.start()
    deadline = time.monotonic() + 30
    while client.server_info()["running"] + client.server_info()["waiting"] < 24:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.pause("in_place")
    try:
        client.set_weight_version(9)
    finally:
        client.resume()
    t.join(120)
    assert len(out["r"]) == 24 and all(len(r.output_ids) == 300 for r in out["r"])
    assert {r.meta_info.weight_version for r in out["r"]} == {"9"}
    client.set_weight_version(0)


def test_a_server_that_cannot_bind_exits_nonzero_with_the_reason(tiny_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "miles_core.engines.cpu.server", "--model", str(tiny_dir)]
            + ["--port", str(port), "--threads", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0
    assert "address already in use" in proc.stderr and f"127.0.0.1:{port} failed" in proc.stderr


def test_an_idle_keep_alive_connection_outlives_a_paused_client(server):
    """A pooled client connection idle for longer than uvicorn's 5 s default keep-alive must
    still work: otherwise the server closes it while a client (the producer, a session's
    generate function) may be reusing it, and that request fails with a ReadError."""
    import http.client
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is not None
    sock = conn.sock
    time.sleep(6)  # the idle time under test, longer than the 5 s default
    sock.settimeout(0)  # peek without waiting: b"" = closed by the server, no data = open
    try:
        closed = sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        closed = False
    sock.settimeout(10)
    assert not closed, "the server closed an idle keep-alive connection"
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200 and conn.sock is sock  # the same connection
    conn.close()


def test_the_weights_check_covers_the_packed_copies_that_generate(tiny):
    """The checksum is of what generates: a packed copy the runner decodes with that no longer
    matches the engine's tensors fails the check (in-process and over /weights_checker)."""
    from fastapi.testclient import TestClient

    from miles_core.engines.cpu.server import create_app
    from miles_core.engines.cpu.serving import PackedWeightsDiffer
    from miles_core.weights import weights_checksum

    model, tok = tiny
    engine = ServingEngine(copy.deepcopy(model), tok)
    try:
        engine.generate([_req(tok, "say a", max_new_tokens=2)])  # packs the weights
        good = engine.weights_checksum()
        assert good == weights_checksum(engine.named_tensors().items())
        runner = engine.runner
        o_proj = engine.named_tensors()["model.layers.0.self_attn.o_proj.weight"]
        runner._w.layers[0].o = runner._pack(o_proj + 1e-3)  # the named tensors are unchanged
        with pytest.raises(PackedWeightsDiffer, match=r"\['layers.0.o'\]"):
            engine.weights_checksum()
        with TestClient(create_app(engine)) as http:
            r = http.post("/weights_checker", json={"action": "checksum"})
            assert r.status_code == 400 and "layers.0.o" in r.json()["message"]
            r = http.post("/weights_checker", json={"action": "snapshot"})
            r = http.post("/weights_checker", json={"action": "compare"})
            assert r.status_code == 400 and "layers.0.o" in r.json()["message"]
        engine.update_weights_from_tensor(list(engine.named_tensors().items()))  # repacks
        assert engine.weights_checksum() == good
    finally:
        engine.close()


def test_the_server_declares_its_weight_routes_and_device(server):
    from miles_core.engines.protocol import SERVER_ROUTES
    from miles_core.engines.sglang import attach

    (engine,) = attach([server.url])
    assert engine.weight_routes == SERVER_ROUTES
    assert engine.server_info()["device"] == "cpu"
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_serving_engine_on_cuda_matches_the_cpu_engine(tiny):
    """Weights, packed copies and the KV cache on the GPU; the same seeded samples as on the
    CPU (uniforms are drawn on the CPU), log-probs within fp32 reordering."""
    model, tok = tiny
    reqs = [_req(tok, t, max_new_tokens=8, sampling_seed=3 + i) for i, t in enumerate(["ab", "c"])]
    cpu = ServingEngine(copy.deepcopy(model), tok)
    gpu = ServingEngine(copy.deepcopy(model), tok, device="cuda")
    try:
        assert all(t.is_cuda for t in gpu.named_tensors().values())
        assert all(kv.is_cuda for kv in gpu.runner.cache.kv)
        for c, g in zip(cpu.generate(reqs), gpu.generate(reqs), strict=True):
            assert c.output_ids == g.output_ids
            assert torch.allclose(
                torch.tensor(c.output_log_probs), torch.tensor(g.output_log_probs), atol=1e-4
            )
        assert gpu.weights_checksum() == cpu.weights_checksum()
    finally:
        cpu.close()
        gpu.close()
