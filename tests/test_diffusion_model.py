"""The diffusion image model and Flow-GRPO's step: a saved model loads back bit for bit and a
foreign directory is refused, η = 0 is the Euler step, the SDE step's log-prob is the Gaussian
one and a trainer's recomputation matches the sampler's bitwise, sampling is seeded,
classifier-free guidance combines (and detaches) its branches as documented, pretraining lowers
the flow-matching loss, and unknown prompt words are refused by name."""

import json
import math

import pytest
import torch

from miles_core.diffusion.model import (
    MODEL_CLASS,
    ImageModel,
    build_image_model,
    load_image_model,
    save_image_model,
)
from miles_core.diffusion.pretrain import flow_matching_batch, flow_matching_loss, pretrain
from miles_core.diffusion.scenes import Scene, split_scenes
from miles_core.diffusion.sde import sample, schedule, sde_step, step_log_prob

PROMPTS = [
    "two red squares on the left",
    "one blue circle at the top",
    "three green triangles at the bottom",
]


@pytest.fixture(scope="module")
def model() -> ImageModel:
    return build_image_model("tiny", seed=0)


def _inputs(model: ImageModel, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = model.image_size
    return torch.randn((len(PROMPTS), 3, size, size), generator=generator), model.encode(PROMPTS)


@pytest.mark.parametrize(("preset", "component"), [("tiny", "transformer"), ("unet-tiny", "unet")])
def test_save_load_round_trip_gives_the_same_velocity_bitwise(preset, component, tmp_path):
    model = build_image_model(preset, seed=0)
    directory = save_image_model(model, tmp_path / "model")
    for name in ("model_index.json", "vocabulary.json", "scheduler/scheduler_config.json"):
        assert (directory / name).is_file()
    assert (directory / component / "config.json").is_file()
    assert json.loads((directory / "model_index.json").read_text())[component][0] == "diffusers"
    assert (directory / "text_encoder" / "model.safetensors").is_file()
    loaded = load_image_model(directory)
    x, ids = _inputs(model)
    sigma = torch.tensor([1.0, 0.5, 0.1])
    with torch.no_grad():
        assert torch.equal(model.velocity(x, sigma, ids, 3.0), loaded.velocity(x, sigma, ids, 3.0))
    assert loaded.vocabulary == model.vocabulary and loaded.image_size == model.image_size


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an image model directory.*save_image_model"):
        load_image_model(tmp_path)
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusion3Pipeline"})
    )
    with pytest.raises(ValueError, match="names 'StableDiffusion3Pipeline'"):
        load_image_model(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": MODEL_CLASS}))
    with pytest.raises(
        ValueError, match=r"one denoiser component, one of \['transformer', 'unet'\]"
    ):
        load_image_model(tmp_path)


def test_eta_zero_is_the_euler_step_and_has_no_log_prob():
    generator = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(2, 3, 8, 8, generator=generator) for _ in range(3))
    x_next, mean, std = sde_step(x, v, 0.7, 0.6, 0.0, noise, 0.9)
    dt = torch.tensor(0.6, dtype=torch.float32) - torch.tensor(0.7, dtype=torch.float32)
    assert torch.equal(x_next, x + v * dt) and torch.equal(mean, x_next)
    assert not std.any()
    with pytest.raises(ValueError, match="eta > 0"):
        step_log_prob(x_next, mean, std)


def _reference_log_prob(x, v, sigma, sigma_next, eta, noise, sigma_1):
    """Flow-GRPO's step and Gaussian log-prob, in float64, written out from the formulas."""
    x, v, noise = x.double(), v.double(), noise.double()
    dt = sigma_next - sigma
    std_t = eta * math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
    mean = (
        x * (1 + std_t**2 * dt / (2 * sigma)) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_t * math.sqrt(-dt)
    x_next = mean + std * noise
    density = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return x_next, density.mean(dim=(1, 2, 3))


@pytest.mark.parametrize("sigma, sigma_next", [(1.0, 0.9), (0.55, 0.4), (0.1, 0.001)])
def test_sde_log_prob_is_the_closed_form_gaussian(sigma, sigma_next):
    generator = torch.Generator().manual_seed(2)
    x, v, noise = (torch.randn(3, 3, 8, 8, generator=generator) for _ in range(3))
    x_next, mean, std = sde_step(x, v, sigma, sigma_next, 0.7, noise, 0.9)
    log_prob = step_log_prob(x_next, mean, std)
    assert log_prob.dtype == torch.float32 and log_prob.shape == (3,)
    ref_next, ref_log_prob = _reference_log_prob(x, v, sigma, sigma_next, 0.7, noise, 0.9)
    torch.testing.assert_close(x_next.double(), ref_next, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_prob.double(), ref_log_prob, rtol=1e-5, atol=1e-5)


def test_recomputed_log_probs_equal_the_samplers_bitwise(model):
    _, ids = _inputs(model)
    images, trajectory = sample(model, ids, 4, 0.7, 2.0, torch.Generator().manual_seed(3))
    steps = trajectory.sigmas.shape[0] - 1
    assert trajectory.latents.shape == (3, steps + 1, 3, model.image_size, model.image_size)
    assert trajectory.log_probs.shape == (3, steps) and torch.isfinite(trajectory.log_probs).all()
    assert torch.equal(images, trajectory.latents[:, -1].clamp(-1, 1))
    sigma_1 = float(trajectory.sigmas[1])
    for j in range(steps):  # the trainer's forward: with gradient, unconditional branch detached
        x, x_next = trajectory.latents[:, j], trajectory.latents[:, j + 1]
        sigma, sigma_next = trajectory.sigmas[j], trajectory.sigmas[j + 1]
        v = model.velocity(x, sigma, ids, 2.0, detach_unconditional=True)
        _, mean, std = sde_step(x, v, sigma, sigma_next, 0.7, None, sigma_1)
        assert torch.equal(step_log_prob(x_next, mean, std).detach(), trajectory.log_probs[:, j])


def test_sampling_is_deterministic_under_a_seed(model):
    _, ids = _inputs(model)
    first = sample(model, ids, 3, 0.7, 2.0, torch.Generator().manual_seed(4))
    again = sample(model, ids, 3, 0.7, 2.0, torch.Generator().manual_seed(4))
    other = sample(model, ids, 3, 0.7, 2.0, torch.Generator().manual_seed(5))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1].log_probs, again[1].log_probs)
    assert not torch.equal(first[0], other[0])
    ode, none = sample(model, ids, 3, 0.0, None, torch.Generator().manual_seed(4))
    assert none is None and torch.equal(
        ode, sample(model, ids, 3, 0.0, None, torch.Generator().manual_seed(4))[0]
    )
    sigmas = schedule(model.scheduler, 3)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas.diff() < 0).all()


def test_guidance_combines_the_branches_and_can_detach_the_unconditional_one(model):
    x, ids = _inputs(model)
    null = torch.ones(len(PROMPTS), dtype=torch.bool)
    with torch.no_grad():
        conditional, unconditional = model(x, 0.6, ids), model(x, 0.6, ids, null)
        guided = model.velocity(x, 0.6, ids, 4.5)
        assert torch.equal(guided, unconditional + 4.5 * (conditional - unconditional))
        assert torch.equal(model.velocity(x, 0.6, ids), conditional)
    null_states = model.text_encoder.null_states
    for detach, reaches_null in ((False, True), (True, False)):
        model.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        v = model.velocity(x_in, 0.6, ids, 4.5, detach_unconditional=detach)
        assert v.requires_grad
        v.square().sum().backward()
        # the null prompt feeds only the unconditional branch
        assert (null_states.grad is not None and null_states.grad.abs().sum() > 0) == reaches_null
    # detached: the gradient is that of w·v_c alone
    x_in = x.clone().requires_grad_(True)
    unconditional = unconditional.detach()
    (unconditional + 4.5 * (model(x_in, 0.6, ids) - unconditional)).square().sum().backward()
    expected = x_in.grad
    x_in = x.clone().requires_grad_(True)
    model.velocity(x_in, 0.6, ids, 4.5, detach_unconditional=True).square().sum().backward()
    torch.testing.assert_close(x_in.grad, expected)
    model.zero_grad(set_to_none=True)


def test_pretraining_lowers_the_flow_matching_loss(tmp_path):
    fresh = build_image_model("tiny", seed=0)
    train, _ = split_scenes()
    batch = flow_matching_batch(
        fresh, train[:32], seed=99, generator=torch.Generator().manual_seed(9)
    )
    with torch.no_grad():
        before = float(flow_matching_loss(fresh, batch))
    directory = pretrain("tiny", tmp_path / "pretrained", steps=40, batch_size=16, lr=2e-3, seed=0)
    with torch.no_grad():
        after = float(flow_matching_loss(load_image_model(directory), batch))
    assert after < 0.8 * before, (before, after)
    with pytest.raises(ValueError, match="size=24"):
        pretrain("tiny", tmp_path / "other", steps=1, size=32)


def test_an_unknown_prompt_word_is_refused_by_name(model):
    with pytest.raises(ValueError, match="unknown word 'purple'.*'red'"):
        model.encode(["two purple squares on the left"])
    with pytest.raises(ValueError, match="has 3 words"):
        model.encode(["two red squares"])
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        model(torch.zeros(1, 3, 24, 24), 0.5, torch.full((1, 6), 20))
    assert model.encode([Scene(1, "red", "circle", "left").prompt]).shape == (1, 6)
