"""Trainer backends and losses as plug-ins: chosen by name or import path, refused clearly at
config time, rebuilt identically on follower ranks; the device a trainer runs on."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from pydantic import ValidationError

from miles_core.config import RunConfig, load_config
from miles_core.device import check_device, dist_backend, resolve_device
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.rollout.rollout_fn import RolloutResult, encode_prompt
from miles_core.run.training import build_trainer, train_on_rollout
from miles_core.train import distributed
from miles_core.train.advantage import ADVANTAGES
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch
from miles_core.train.loss import LOSSES, loss_options
from miles_core.train.losses.policy import OffPolicyOptions, PolicyOptions
from miles_core.types import Sample, SampleGroup
from tests.plugins import backend as plugin

PLUGIN = "tests.plugins.backend:RecordingBackend"


def _settings(**overrides):
    """The train section as a trainer gets it; the policy loss's keys go to its options."""
    loss = {k: overrides.pop(k) for k in list(overrides) if k in PolicyOptions.model_fields}
    update = {"micro_batch_size": 4, "loss_options": PolicyOptions(**loss), **overrides}
    return RunConfig().train.model_copy(update=update).model_dump()


def _trainer(model_dir, name="fsdp", **overrides):
    s = _settings(**overrides)
    return BACKENDS.get(name)(model_dir=str(model_dir), optim=s, loss=s, total_steps=4)


def _sft_batch(tok):
    prompt = encode_prompt(tok, "say a")
    answers = ["aaaa", "aa", "aaaaaa", "a"]
    rows = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
    return TrainBatch(
        tokens=[prompt + r for r in rows],
        response_lengths=[len(r) for r in rows],
        loss_masks=[[1] * (len(r) - 1) + [0] for r in rows],  # a masked-out token per row
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.backend=deepspeed",
            "unknown trainer backend 'deepspeed' in train.backend; known: fsdp, megatron",
        ),
        (
            "train.backend=tests.plugins.nowhere:X",
            "cannot import trainer backend 'tests.plugins.nowhere:X': no module",
        ),
        ("train.backend=tests.plugins.backend:Missing", "has no 'Missing'"),
        (
            "train.loss=kd",
            "unknown loss 'kd' in train.loss; known: diffusion_nft, distill, flow_grpo, policy, sft",
        ),
        ("train.loss=tests.plugins.backend:Nope", "has no 'Nope'"),
        ("train.loss=miles_core.train.loss_terms:aggregate", "is not a loss: it needs"),
    ],
)
def test_an_unknown_backend_or_loss_is_refused_at_config_time(override, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        load_config(None, [override])


def test_a_backend_and_a_loss_by_import_path_pass_config_validation():
    config = load_config(
        None, [f"train.backend={PLUGIN}", "train.loss=tests.plugins.backend:DoubledSFT"]
    )
    assert (config.train.backend, config.train.loss, config.train.device) == (
        PLUGIN,
        "tests.plugins.backend:DoubledSFT",
        "auto",
    )


def test_validating_a_config_imports_only_the_plugins_it_names():
    code = "import sys; from miles_core.config import load_config; "
    code += "load_config(None, ['train.backend=fsdp', 'train.loss=policy']); "
    code += "print(sorted(m for m in sys.modules if m.startswith(('miles_core.', 'transformers'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))
    # the named ones, for their options; none of the others, and no model code
    assert {"miles_core.train.backends.fsdp", "miles_core.train.losses.policy"} <= loaded
    assert (
        not {
            "miles_core.train.backends.megatron.backend",
            "miles_core.train.advantages.rloo",
            "miles_core.weights.transports.disk",
            "miles_core.engines.kinds.server",
            "transformers",
        }
        & loaded
    )
    assert BACKENDS.names() == ["fsdp", "megatron"]


def test_followers_rebuild_the_backend_class_rank_0_announced(tiny_dir, monkeypatch):
    announced = []
    monkeypatch.setattr(
        distributed, "announce", lambda name, payload: announced.append(name and payload)
    )
    trainer = _trainer(tiny_dir, PLUGIN)
    init = announced[0]
    assert init["backend"] == PLUGIN and init["kwargs"]["device"] == "cpu"
    assert type(trainer) is plugin.RecordingBackend
    follower = BACKENDS.get(init["backend"])(**init["kwargs"])  # what distributed.follow does
    assert type(follower) is plugin.RecordingBackend
    for a, b in zip(trainer.model.parameters(), follower.model.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_the_policy_loss_reads_its_typed_options_and_refuses_unknown_ones():
    off = OffPolicyOptions(mode="tis", high=1.5)
    settings = _settings(eps_clip_high=0.28, kl_coef=0.1, off_policy=off)
    policy = LOSSES.get("policy")
    cfg = policy.config(loss_options(settings, "policy"))
    assert cfg == PolicyOptions(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.1, off_policy=off)
    assert loss_options(settings, "sft") == {}  # the run's loss options are the policy loss's
    with pytest.raises(ValidationError, match="kl_coeff"):
        policy.config({"kl_coeff": 0.1})
    with pytest.raises(ValidationError, match=r"train.loss_options.kl_coeff\n +Extra inputs"):
        load_config(None, ["train.loss_options.kl_coeff=0.1"])


def test_a_custom_loss_is_used_by_name_or_import_path_and_an_unknown_one_refused(tiny_dir, tiny):
    _, tok = tiny
    batch = _sft_batch(tok)
    base = _trainer(tiny_dir).train_step(batch, loss="sft")
    LOSSES.register("doubled_sft", plugin.DoubledSFT)
    for name in ("doubled_sft", "tests.plugins.backend:DoubledSFT"):
        m = _trainer(tiny_dir).train_step(batch, loss=name)
        # every micro-batch (4 rows, micro_batch_size 4 → one) saw the masks as built
        assert m["masked_tokens"] == sum(sum(x) for x in batch.loss_masks) == 13.0
        assert m["loss"] == 2 * base["loss"]
        assert m["grad_norm"] == pytest.approx(2 * base["grad_norm"], rel=1e-6)
    with pytest.raises(
        ValueError,
        match="unknown loss 'nope' in train.loss; known: diffusion_nft, distill, doubled_sft, flow_grpo, policy, sft",
    ):
        _trainer(tiny_dir).train_step(batch, loss="nope")


def _rollout_result(model, tok, groups=4, n=2) -> RolloutResult:
    """`groups` GRPO groups of `n` samples of the tiny model (3–6 tokens), seeded rewards."""
    prompt = encode_prompt(tok, "say a")
    reqs = [
        GenerateRequest(
            input_ids=prompt,
            sampling_params=SamplingParams(max_new_tokens=3 + i % 4, stop_token_ids=[]),
        )
        for i in range(groups * n)
    ]
    out = EmbeddedEngine(model, tok, seed=0).generate(reqs)
    samples = [
        Sample(
            group_index=i // n,
            index=i % n,
            rollout_id=f"r{i}",
            prompt="say a",
            tokens=prompt + o.output_ids,
            response_length=len(o.output_ids),
            loss_mask=[1] * len(o.output_ids),
            rollout_log_probs=list(o.output_log_probs),
            reward=float(i % 3),
        )
        for i, o in enumerate(out)
    ]
    return RolloutResult([SampleGroup(g, samples[g * n : (g + 1) * n]) for g in range(groups)])


def _rl_config(*overrides):
    base = ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2"]
    base += ["train.micro_batch_size=4", f"train.backend={PLUGIN}", "train.device=cpu"]
    return load_config(None, [*base, *overrides])


@pytest.mark.parametrize(
    "settings",
    [
        [],
        # the corrections and mismatch stats compare π_old with the engine's log-probs
        [
            "train.loss_options.off_policy.mode=tis",
            "train.loss_options.kl_coef=0.1",
            "train.loss_options.entropy_coef=0.01",
        ],
        [
            "train.loss_options.loss_agg=seq_mean_token_mean",
            "train.loss_options.off_policy.mode=icepop",
        ],
    ],
)
def test_one_optimizer_step_per_rollout_takes_old_log_probs_from_its_own_forward(
    tiny_dir, tiny, settings
):
    """global_batch_size covers the rollout: no recompute (`old_is_current`), and every metric
    and every weight after the step is bitwise what the recompute gives."""
    config = _rl_config("train.global_batch_size=8", *settings)
    result = _rollout_result(*tiny)
    plugin.CALLS.clear()
    fast = build_trainer(config, tiny_dir)
    metrics = train_on_rollout(fast, config, result)
    assert plugin.CALLS == ["init", "train_step:policy:8"]

    ref = build_trainer(config, tiny_dir)
    adv = ADVANTAGES.get("grpo")(result.groups, config.train.advantage_estimator_options)
    batch = TrainBatch.from_samples(result.samples, adv, config.rollout.temperature)
    batch.old_log_probs = ref.compute_log_probs(batch)
    expected = {f"train/{k}": v for k, v in ref.train_step(batch).items()}
    assert metrics == expected
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/train_rollout_logprob_abs_diff"] > 0.0  # the engine's, compared
    for a, b in zip(fast.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_several_optimizer_steps_per_rollout_recompute_the_old_log_probs_first(tiny_dir, tiny):
    config = _rl_config("train.global_batch_size=4")
    plugin.CALLS.clear()
    metrics = train_on_rollout(build_trainer(config, tiny_dir), config, _rollout_result(*tiny))
    assert plugin.CALLS == ["init", "compute_log_probs:8"] + ["train_step:policy:4"] * 2
    assert metrics["train/ppo_kl"] != 0.0  # the second step is off the old policy


def test_a_model_with_dropout_recomputes_the_old_log_probs(tiny_dir, tiny, tmp_path):
    """Its training forward is not the no-grad one: π_old cannot be taken from it."""
    shutil.copytree(tiny_dir, tmp_path / "model")
    cfg_file = tmp_path / "model" / "config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"attention_dropout": 0.1}))
    config = _rl_config("train.global_batch_size=8")
    plugin.CALLS.clear()
    train_on_rollout(build_trainer(config, tmp_path / "model"), config, _rollout_result(*tiny))
    assert plugin.CALLS == ["init", "compute_log_probs:8", "train_step:policy:8"]


def test_a_loss_without_old_log_probs_is_a_clear_error(tiny_dir, tiny):
    config = _rl_config("train.global_batch_size=8")
    result = _rollout_result(*tiny)
    adv = ADVANTAGES.get("grpo")(result.groups, config.train.advantage_estimator_options)
    batch = TrainBatch.from_samples(result.samples, adv, config.rollout.temperature)
    with pytest.raises(ValueError, match="needs the old log-probs"):
        build_trainer(config, tiny_dir).train_step(batch)


def test_devices_resolve_and_cuda_without_cuda_is_a_clear_error():
    assert resolve_device("cpu") == torch.device("cpu")
    assert dist_backend("cpu") == "gloo"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            check_device("cuda")
        with pytest.raises(ValidationError, match="torch sees no CUDA device"):
            load_config(None, ["train.device=cuda"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_training_step_on_cuda(tiny_dir, tmp_path):
    """In its own process: this one's trainer group is gloo already."""
    script = Path(__file__).parent / "scripts" / "cuda_step.py"
    out = tmp_path / "cuda.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(script), str(tiny_dir), str(out)], env=env, check=True, timeout=300
    )
    r = json.loads(out.read_text())
    assert r["device"].startswith("cuda") and r["param_dtype"] == "torch.float32"
    assert r["compute_dtype"] == "torch.bfloat16"
    assert r["max_logprob_diff_vs_cpu"] < 0.1  # bf16 compute vs the fp32 engine
    assert r["ppo_kl"] == pytest.approx(0.0, abs=1e-4) and r["grad_norm"] > 0
    assert r["weights_moved"]


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_plugins_from_the_test_tree_train_through_the_flow(prefect_server, tmp_path, monkeypatch):
    """A trainer backend, a rollout engine, a weight transport and an advantage estimator of
    tests/plugins/, each with what it needs from the config, in one run; nothing inside
    miles_core names them."""
    from flows.rl_train import rl_train
    from tests.plugins import estimator

    monkeypatch.chdir(tmp_path)
    plugin.CALLS.clear()
    estimator.CALLS.clear()
    config = load_config(
        None,
        [
            "name=plugin-backend",
            "model.preset=tiny",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=4",
            "train.num_steps=2",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            f"train.backend={PLUGIN}",
            "rollout.engine=tests.plugins.engine:CountingEngine",
            f"rollout.engine_options.record={tmp_path}/generate.txt",
            "weight_sync.transport=tests.plugins.transport:JournaledTransport",
            f"weight_sync.transport_options.journal={tmp_path}/pushes.jsonl",
            "weight_sync.check_equal=true",
            "train.advantage_estimator=tests.plugins.estimator:RankEstimator",
            "train.advantage_estimator_options.scale=0.5",
            f"checkpoint.root={tmp_path}/ckpt",
            "checkpoint.interval=2",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            "tracking.experiment=plugin-backend",
        ],
    )
    state = rl_train(config, return_state=True)
    assert state.is_completed()
    # one optimizer step per rollout: its old log-probs are its own forward's (no recompute)
    assert plugin.CALLS == ["init"] + ["train_step:policy:8"] * 2 + ["save"]
    # every rollout generated through the engine plug-in; every push went through the transport
    assert (tmp_path / "generate.txt").read_text().split() == ["8", "8"]
    pushes = [json.loads(line) for line in (tmp_path / "pushes.jsonl").read_text().splitlines()]
    assert [p["version"] for p in pushes] == [1, 2] and all(p["bytes"] > 0 for p in pushes)
    # 4 groups of 2 per step, each ranked: ±0.5 apart, or 0 for a tie
    assert len(estimator.CALLS) == 8
    assert all(sorted(a) in ([-0.5, 0.5], [0.0, 0.0]) for a in estimator.CALLS)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("plugin-backend").experiment_id])[0]
    assert run.data.params["train.backend"] == PLUGIN
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/grad_norm")] == [0, 1]
