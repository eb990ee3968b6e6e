"""The image engine, in process and as a server: a rollout is seeded and carries a trajectory
whose log-probs a trainer recomputes bit for bit; the server answers what the in-process engine
answers, bit for bit; weights pushed by the shared-memory and disk transports are loaded and
checked by checksum, and a bad load changes nothing; bad requests (a word outside the
vocabulary, another resolution, zero steps, η < 0) are 400 with their reason; the server
requires the run's key and refuses a non-loopback address without one; fuzzed, it answers
below 500."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient

from miles_core.diffusion.client import ImageEngineClient, ImageEngineProcess
from miles_core.diffusion.engine import ImageEngine
from miles_core.diffusion.model import build_image_model, load_image_model, save_image_model
from miles_core.diffusion.sde import sde_step, step_log_prob
from miles_core.diffusion.server import create_app
from miles_core.diffusion.wire import RolloutOutput, RolloutRequest
from miles_core.engines.protocol import EngineRequestRejected
from miles_core.processes.auth import API_KEY_ENV, protect
from miles_core.weights import TRANSPORTS, TransportContext, weights_checksum
from miles_core.weights.source import TensorBuckets

PROMPTS = ["two red squares on the left", "one blue circle at the top"]
KEY = "test-key-123"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_image_model(build_image_model("tiny", 0), tmp_path_factory.mktemp("img") / "m")


@pytest.fixture
def engine(model_dir) -> ImageEngine:
    return ImageEngine(load_image_model(model_dir))


def _request(**kw) -> RolloutRequest:
    return RolloutRequest(prompt=PROMPTS, num_outputs_per_prompt=3, num_inference_steps=4, **kw)


def _perturbed(engine: ImageEngine, scale: float = 0.01) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        n: t + scale * torch.randn(t.shape, generator=gen)
        for n, t in engine.named_tensors().items()
    }


def test_a_rollout_is_seeded_and_its_log_probs_are_recomputed_bitwise(engine):
    req = _request(guidance_scale=2.0, seed=3)
    out = engine.rollout(req)
    n = len(PROMPTS) * 3
    assert out.images.shape == (n, 3, 24, 24) and out.latents.shape == (n, 5, 3, 24, 24)
    assert out.log_probs.shape == (n, 4) and out.sigmas.shape == (5,)
    again = engine.rollout(req)
    assert torch.equal(out.latents, again.latents) and torch.equal(out.log_probs, again.log_probs)
    assert not torch.equal(out.latents, engine.rollout(_request(seed=4)).latents)
    # the trainer's recomputation: the same model and step code on the stored transitions
    ids = req.check_for(24, engine.model.encode)
    sigma_1 = float(out.sigmas[1])
    for j in range(4):
        x = out.latents[:, j]
        with torch.no_grad():
            v = engine.model.velocity(x, out.sigmas[j], ids, 2.0)
        _, mean, std = sde_step(x, v, out.sigmas[j], out.sigmas[j + 1], 0.7, None, sigma_1)
        assert torch.equal(step_log_prob(out.latents[:, j + 1], mean, std), out.log_probs[:, j])


def test_an_evaluation_request_runs_the_ode_and_returns_images_only(engine):
    out = engine.rollout(_request(rollout=False))
    assert out.latents is None and out.log_probs is None and out.images.shape[0] == 6
    assert float(out.images.abs().max()) <= 1.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"rollout_noise_level": -0.1}, "rollout_noise_level"),
        ({"rollout_sde_type": "ode"}, "rollout_noise_level > 0"),
        ({"prompt": []}, "prompt"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
    ],
)
def test_a_malformed_request_is_refused_with_its_reason(change, message):
    with pytest.raises(ValueError, match=message):
        RolloutRequest(**({"prompt": PROMPTS} | change))


def test_a_request_the_model_cannot_take_is_refused_by_the_engine(engine):
    with pytest.raises(ValueError, match="unknown word 'purple'"):
        engine.rollout(RolloutRequest(prompt=["two purple squares on the left"]))
    with pytest.raises(ValueError, match="height 32: this model makes 24×24 images only"):
        engine.rollout(RolloutRequest(prompt=PROMPTS, height=32, width=32))


def test_a_load_is_all_or_nothing(engine):
    before = engine.weights_checksum()
    good = list(_perturbed(engine).items())
    with pytest.raises(ValueError, match="unknown weight 'nope'"):
        engine.update_weights_from_tensor([*good, ("nope", torch.zeros(1))])
    name, tensor = good[0]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensor([*good[1:], (name, tensor[..., :1])])
    assert engine.weights_checksum() == before
    engine.update_weights_from_tensor(good)
    assert engine.weights_checksum() == weights_checksum(good)


@pytest.fixture
def app_client(engine, tmp_path):
    app = protect(create_app(engine, weight_roots=[str(tmp_path)]), KEY)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def test_the_server_answers_what_the_engine_answers_bitwise(engine, app_client):
    req = _request(guidance_scale=2.0, seed=5)
    r = app_client.post("/rollout/generate", json=req.model_dump(mode="json"))
    assert r.status_code == 200, r.text
    served = RolloutOutput.from_json(r.json())
    local = engine.rollout(req)
    for name in ("images", "latents", "log_probs", "sigmas"):
        assert torch.equal(getattr(served, name), getattr(local, name)), name
    assert served.weight_version == 0


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": ["two purple squares on the left"]}, "unknown word 'purple'"),
        ({"prompt": PROMPTS, "height": 512, "width": 512}, "this model makes 24×24"),
        ({"prompt": PROMPTS, "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": PROMPTS, "rollout_noise_level": -1}, "rollout_noise_level"),
        ({"prompt": PROMPTS, "sampler": "dpm"}, "sampler"),
        (
            {"prompt": PROMPTS, "num_outputs_per_prompt": 512, "num_inference_steps": 200},
            "more than 16384 in one request",
        ),
        ({"prompt": "two red squares on the left"}, "prompt"),
    ],
)
def test_the_server_refuses_bad_requests_with_400(app_client, body, message):
    r = app_client.post("/rollout/generate", json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text
    assert app_client.get("/health").status_code == 200


def test_the_server_requires_the_key(engine, app_client):
    with TestClient(app_client.app) as keyless:
        assert keyless.post("/rollout/generate", json={"prompt": PROMPTS}).status_code == 401
        assert keyless.get("/health").status_code == 200
    assert app_client.get("/get_model_info").json()["image_size"] == 24


@pytest.mark.slow  # a subprocess that imports torch
def test_a_non_loopback_address_without_a_key_is_refused_at_start(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    port_file = tmp_path / "port"
    done = subprocess.run(
        [sys.executable, "-m", "miles_core.diffusion.server", "--model", str(model_dir)]
        + ["--host", "0.0.0.0", "--port", "0", "--port-file", str(port_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "refusing to serve on 0.0.0.0 without an API key" in (
        done.stderr
    )
    assert not port_file.exists()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server subprocess for the transports, the client and the fuzzer (keyless: the key
    rules are checked above, on the same app)."""
    roots = tmp_path_factory.mktemp("weights")
    with ImageEngineProcess(
        model_dir,
        args=["--threads", "1"],
        log_path=roots / "engine.log",
        weight_roots=[str(roots)],
    ) as process:
        client = ImageEngineClient(process.url)
        yield process, client, roots
        client.close()


@pytest.mark.slow  # an image engine server of its own
@pytest.mark.parametrize("transport", ["shared_memory", "disk"])
def test_transports_push_to_the_server_and_the_checksum_matches(server, engine, transport):
    process, client, roots = server
    context = TransportContext(workdir=roots)
    options = TRANSPORTS.get(transport).Options.model_validate(
        {"root": str(roots / "pushes")} if transport == "disk" else {}
    )
    push = TRANSPORTS.get(transport).build(context, options)
    push.connect([client])
    weights = _perturbed(engine, 0.02 if transport == "disk" else 0.01)
    try:
        stats = push.push(TensorBuckets([list(weights.items())]), version=4)
    finally:
        push.close()
    assert stats.bytes > 0 and client.weight_version == 4
    assert client.weights_checksum() == weights_checksum(weights.items())
    # and it generates with them: the same answer as an engine holding the same weights, on
    # the server's thread count (a GEMM's reduction order may depend on it)
    engine.update_weights_from_tensor(weights.items())
    req = _request(seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = engine.rollout(req)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(client.rollout(req).latents, local.latents)
    with pytest.raises(EngineRequestRejected, match="unknown word 'purple'"):
        client.rollout(RolloutRequest(prompt=["one purple square on the left"]))


@pytest.mark.slow  # ≈150 requests
def test_the_image_engine_server_answers_every_fuzzed_request_below_500(server):
    from tests.test_fuzz import fuzz

    process, client, _ = server
    counts = fuzz(process.url)
    assert counts["requests"] > 100 and counts["4xx"] > 0
    out = client.rollout(RolloutRequest(prompt=PROMPTS, num_inference_steps=2))
    assert out.log_probs.shape == (2, 2)
