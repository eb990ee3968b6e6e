"""Image RL: Flow-GRPO's trainer recomputes the engine's per-step log-probs bit for bit before
its first optimizer step, whatever its micro-batches; the KL term is the Gaussian steps' exact
KL and carries the policy's gradient; DiffusionNFT's loss is its formula; an image run resumed
from a checkpoint repeats the uninterrupted one bit for bit; an image run goes through the
`miles train` flow with its metrics and image grids in MLflow, and fully asynchronously on an
engine server; settings that cannot work are refused before anything starts."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from miles_core.config import load_config
from miles_core.diffusion.engine import ImageEngine
from miles_core.diffusion.loss import ImageMicroBatch, ImageModels
from miles_core.diffusion.model import build_image_model, save_image_model
from miles_core.diffusion.rollout import Sampling, image_rollout, step_scenes
from miles_core.diffusion.scenes import split_scenes
from miles_core.diffusion.sde import sde_step
from miles_core.diffusion.trainer import ImageTrainer
from miles_core.train.loss import LOSSES

OPTIM = {
    "lr": 1e-3,
    "min_lr": 0.0,
    "lr_warmup_steps": 0,
    "lr_decay_style": "constant",
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "grad_clip": 1.0,
    "micro_batch_size": 4,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved model of each denoiser family: the MMDiT and the UNet."""
    root = tmp_path_factory.mktemp("rl")
    return {p: save_image_model(build_image_model(p, 0), root / p) for p in ("tiny", "unet-tiny")}


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["tiny"]


def _rollout(engine, step: int = 0, eta: float = 0.7, prompts: int = 3, n: int = 4, per=None):
    from miles_core.train.advantages.grpo import GRPOOptions

    scenes = step_scenes(split_scenes()[0], prompts, 0, step)
    sampling = Sampling(steps=4, eta=eta, guidance=2.0)
    return image_rollout(
        engine, scenes, n, sampling, 11 + step, step, "reward", "grpo", GRPOOptions(), eta > 0, per
    )


def _with_signal(rollout):
    """The rollout with advantages that are not all zero (an untrained model scores alike)."""
    rollout.advantages = torch.linspace(-1.5, 1.5, len(rollout.advantages))
    return rollout


@pytest.mark.parametrize(
    ("preset", "timesteps"), [("tiny", "random"), ("tiny", "first"), ("unet-tiny", "random")]
)
def test_flow_grpo_recomputes_the_engines_log_probs_bitwise_before_its_first_step(
    model_dirs, preset, timesteps
):
    from miles_core.diffusion.model import load_image_model

    model_dir = model_dirs[preset]
    engine = ImageEngine(load_image_model(model_dir))
    # 16 rows sampled 4 to a request, trained in micro-batches of those 4, two optimizer steps
    rollout = _with_signal(_rollout(engine, prompts=4, per=1))
    options = {"timestep_fraction": 0.75, "timesteps": timesteps, "kl_coef": 0.1}
    trainer = ImageTrainer(model_dir, OPTIM | {"micro_batch_size": 4}, "flow_grpo", options, 4)
    metrics = trainer.train_step(rollout, optimizer_steps=2, seed=3)
    assert metrics["train/log_prob_mean_abs_diff"] == 0.0
    assert metrics["train/optimizer_steps"] == 2 and metrics["train/grad_norm"] > 0
    # the second mini-batch was scored after the first step: its ratios moved
    assert metrics["train/ratio"] != 1.0 and metrics["train/kl"] > 0
    assert trainer.weights_checksum() != engine.weights_checksum()


@pytest.mark.parametrize("preset", ["tiny", "unet-tiny"])
def test_the_fsdp2_trainer_steps_as_the_plain_module_and_its_checkpoint_loads_back(
    model_dirs, preset, tmp_path
):
    """One rank, `fully_shard`ed per block as on a GPU or several ranks: the recomputation is
    still exact, and the step's gradient (Adam's first moment after one step) is the plain
    module's up to the gradient norm's summation order, which DTensor changes: the clip scale,
    and so every gradient, may differ in its last bits (64 float32 epsilons of the norm)."""
    from torch.distributed.tensor import DTensor

    from miles_core.diffusion.model import load_image_model

    model_dir = model_dirs[preset]
    engine = ImageEngine(load_image_model(model_dir))
    rollout = _with_signal(_rollout(engine, prompts=4, per=1))
    grads, norms = {}, {}
    for shard in (False, True):
        trainer = ImageTrainer(
            model_dir, OPTIM, "flow_grpo", {"kl_coef": 0.1}, total_steps=4, shard=shard
        )
        metrics = trainer.train_step(rollout, optimizer_steps=1, seed=3)
        assert metrics["train/log_prob_mean_abs_diff"] == 0.0
        state = trainer.optimizer.state  # parameters without a gradient have none
        moments = [state[p]["exp_avg"] for p in trainer.model.parameters() if p in state]
        full = [m.full_tensor() if isinstance(m, DTensor) else m for m in moments]
        grads[shard] = torch.cat([m.flatten() for m in full]) / (1 - OPTIM["adam_beta1"])
        norms[shard] = metrics["train/grad_norm"]
        trainer.save(tmp_path / str(shard))
        again = ImageTrainer(model_dir, OPTIM, "flow_grpo", {"kl_coef": 0.1}, 4, shard=shard)
        again.load(tmp_path / str(shard))
        assert again.weights_checksum() == trainer.weights_checksum()
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)
    gap = (grads[True] - grads[False]).norm() / grads[False].norm()
    assert float(gap) < 64 * torch.finfo(torch.float32).eps, float(gap)


def test_the_kl_is_the_gaussian_steps_kl_and_carries_the_policys_gradient(model_dir):
    from miles_core.diffusion.model import load_image_model

    engine = ImageEngine(load_image_model(model_dir))
    rollout = _rollout(engine)
    rollout.advantages = torch.zeros(len(rollout.advantages))  # the KL term alone
    policy = load_image_model(model_dir)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    loss_fn = LOSSES.get("flow_grpo")
    cfg = loss_fn.config({"kl_coef": 1.0, "timesteps": "first", "timestep_fraction": 0.5})
    batch = ImageMicroBatch(
        ids=rollout.ids,
        advantages=rollout.advantages,
        images=rollout.images,
        sigmas=rollout.sigmas,
        guidance=rollout.guidance,
        eta=rollout.eta,
        latents=rollout.latents,
        old_log_probs=rollout.log_probs,
        steps=torch.zeros(len(rollout.ids), 1, dtype=torch.long),
    )
    models = ImageModels(policy=policy.velocity, reference=reference.velocity)
    loss, stats = loss_fn(models, batch, 0, cfg, float(len(rollout.ids)))
    loss.backward()
    assert stats["_kl"] > 0
    assert sum(float(p.grad.abs().sum()) for p in policy.parameters() if p.grad is not None) > 0
    # the same number from torch.distributions: the two steps' Gaussians, KL averaged over dims
    x, _, sigma, sigma_next, _ = batch.gather_steps(0)
    sigma_1 = float(batch.sigmas[1])
    with torch.no_grad():
        _, mean, std = sde_step(
            x, policy.velocity(x, sigma, batch.ids, 2.0), sigma, sigma_next, 0.7, None, sigma_1
        )
        _, mean_ref, _ = sde_step(
            x, reference.velocity(x, sigma, batch.ids, 2.0), sigma, sigma_next, 0.7, None, sigma_1
        )
    normal = torch.distributions.Normal
    exact = torch.distributions.kl_divergence(normal(mean, std), normal(mean_ref, std))
    assert stats["_kl"] == pytest.approx(float(exact.mean(dim=(1, 2, 3)).sum()), rel=1e-4)


def test_diffusion_nft_loss_is_its_formula(model_dir):
    from miles_core.diffusion.model import load_image_model

    policy = load_image_model(model_dir)
    old = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    gen = torch.Generator().manual_seed(0)
    rows = 3
    x0 = torch.rand((rows, 3, 24, 24), generator=gen) * 2 - 1
    batch = ImageMicroBatch(
        ids=torch.randint(0, 20, (rows, 6), generator=gen),
        advantages=torch.tensor([6.0, 0.0, -2.5]),  # clipped to 5, neutral, negative
        images=x0,
        sigmas=torch.linspace(1, 0, 5),
        guidance=None,
        eta=0.0,
        noise_levels=torch.tensor([0.9, 0.5, 0.25]),
        noise=torch.randn((rows, 3, 24, 24), generator=gen),
    )
    loss_fn = LOSSES.get("diffusion_nft")
    cfg = loss_fn.config({"beta": 0.5})
    loss, _ = loss_fn(ImageModels(policy.velocity, old=old.velocity), batch, 0, cfg, 1.0)
    t = batch.noise_levels.reshape(-1, 1, 1, 1)
    x_t = (1 - t) * x0 + t * batch.noise
    with torch.no_grad():
        v, v_old = (
            policy(x_t, batch.noise_levels, batch.ids),
            old(x_t, batch.noise_levels, batch.ids),
        )
    pos = x_t - t * (0.5 * v + 0.5 * v_old)
    neg = x_t - t * (1.5 * v_old - 0.5 * v)
    r = torch.tensor([1.0, 0.5, 0.25])
    expected = 0.0
    for i in range(rows):
        w_pos = float((pos[i] - x0[i]).abs().mean())
        w_neg = float((neg[i] - x0[i]).abs().mean())
        term = r[i] * ((pos[i] - x0[i]) ** 2).mean() / w_pos
        term += (1 - r[i]) * ((neg[i] - x0[i]) ** 2).mean() / w_neg
        expected += float(5.0 * term / 0.5)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def _image_config(tmp_path, **over):
    sets = {
        "name": "img",
        "diffusion.model": "tiny",
        "diffusion.sampling_steps": 4,
        "diffusion.eval_samples_per_scene": 1,
        "rollout.prompts_per_step": 3,
        "rollout.n_samples_per_prompt": 4,
        "train.loss": "flow_grpo",
        "train.num_steps": 4,
        "train.global_batch_size": 12,
        "train.micro_batch_size": 4,
        "train.lr": 1e-3,
        "weight_sync.check_equal": True,
        "checkpoint.root": str(tmp_path / "ckpt"),
        "checkpoint.interval": 2,
        "tracking.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
    } | over
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def test_a_resumed_image_run_repeats_the_uninterrupted_one_bitwise(model_dir, tmp_path):
    from miles_core.diffusion.runtime import ImageRuntime

    def run(config, steps, resume_from=None):
        rt = ImageRuntime(config, model_dir, None)
        out = []
        try:
            if resume_from is not None:
                rt.resume(resume_from)
            for step in steps:
                rollout = rt.rollout(step)
                metrics = rollout.metrics | rt.train(rollout)
                metrics |= rt.update_weights()
                out.append({k: v for k, v in metrics.items() if not k.startswith("perf/")})
                if rt.is_save_step(step):
                    rt.save(step, metrics)
            return out, rt.engine_checksum()
        finally:
            rt.close()

    config = _image_config(tmp_path)
    whole, checksum = run(config, range(4))
    assert all(m["train/log_prob_mean_abs_diff"] == 0.0 for m in whole)
    assert [m["train/policy_version"] for m in whole] == [1.0, 2.0, 3.0, 4.0]
    resumed, resumed_checksum = run(config, range(2, 4), resume_from=1)
    assert resumed == whole[2:] and resumed_checksum == checksum


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"diffusion.noise_level": -0.1}, "diffusion.noise_level"),
        ({"diffusion.sampling_steps": 0}, "diffusion.sampling_steps"),
        ({"diffusion.noise_level": 0}, "diffusion.noise_level must be > 0"),
        ({"diffusion.grid_prompts": '["two purple squares on the left"]'}, "unknown word 'purple'"),
        ({"train.loss": "policy"}, "train.loss policy is a text loss"),
        ({"rollout.engine": "serving"}, r"an image run's engine is one of embedded \| server"),
        (
            {"rollout.engine": "server", "weight_sync.transport": "broadcast"},
            "weight_sync.transport broadcast cannot push to an image engine server",
        ),
        ({"diffusion.model": "/nowhere", "diffusion.pretrain_steps": 5}, "a saved model"),
        ({"eval.mode": "dedicated", "eval.every": 2}, "eval.mode dedicated"),
    ],
)
def test_image_settings_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValidationError, match=message):
        _image_config(tmp_path, **overrides)


def test_an_image_loss_without_a_diffusion_section_is_refused():
    from miles_core.config.diffusion import IMAGE_PRESETS
    from miles_core.diffusion.model import PRESETS

    with pytest.raises(ValidationError, match="train.loss flow_grpo trains an image model"):
        load_config(None, ["train.loss=flow_grpo"])
    assert IMAGE_PRESETS == tuple(PRESETS)  # the config's list, without importing diffusers


def test_the_cli_refuses_a_resolution_or_model_the_run_cannot_take(tmp_path, capsys, monkeypatch):
    from flows import cli

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may start
    monkeypatch.chdir(tmp_path)
    base = [
        "diffusion.model=tiny",
        "train.loss=flow_grpo",
        "train.global_batch_size=64",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/m.db",
    ]
    cases = [
        (
            ["diffusion.resolution=512"],
            "diffusion.resolution 512: diffusion.model tiny makes 24×24",
        ),
        ([f"diffusion.model={tmp_path}"], "not an image model directory"),
        (["diffusion.noise_level=-1"], "diffusion.noise_level"),
        (["diffusion.sampling_steps=0"], "diffusion.sampling_steps"),
    ]
    for sets, message in cases:
        args = [a for s in base + sets for a in ("--set", s)]
        assert cli.main(["train", *args]) == 2, sets
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "m.db").exists()


@pytest.mark.slow  # the Prefect flow and an image engine server
@pytest.mark.usefixtures("mlflow_store")
def test_an_image_run_goes_through_the_flow_fully_async_with_its_grids_in_mlflow(
    prefect_server, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    from flows.rl_train import rl_train

    monkeypatch.chdir(tmp_path)
    config = _image_config(
        tmp_path,
        **{
            "name": "img-flow",
            "diffusion.pretrain_steps": 10,
            "rollout.engine": "server",
            "rollout.mode": "fully_async",
            "weight_sync.transport": "shared_memory",
            "eval.mode": "shared",
            "eval.every": 2,
            "tracking.experiment": "img-flow",
        },
    )
    state = rl_train(config, return_state=True)
    assert state.is_completed()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("img-flow").experiment_id])[0]
    history = lambda key: client.get_metric_history(run.info.run_id, key)  # noqa: E731
    for key in ("colour", "count", "shape", "position", "all"):
        assert len(history(f"rollout/reward_{key}")) == 4, key
    assert [m.step for m in history("pretrain/loss")] == [10]
    assert max(m.value for m in history("rollout/staleness")) <= 1  # fully_async's bound
    assert sorted(m.step for m in history("eval/held_out_all")) == [0, 2, 4]
    # one image grid per evaluation, under the version it shows
    images = {a.path for a in client.list_artifacts(run.info.run_id, "eval_grids")}
    assert images == {f"eval_grids/version_{v:06d}.png" for v in (0, 2, 4)}
    logged = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert sum(p.endswith(".png") and "eval_grid+step+" in p for p in logged) == 3
    versions = client.search_model_versions("name='img-flow'")
    assert sorted(int(v.tags["step"]) for v in versions) == [1, 3]
