"""Multi-rank training on real torchrun ranks over gloo:

- a 2-rank FSDP2 step equals the 1-rank step within 1e-5 (also for a batch whose rows do not
  split evenly);
- the Megatron backend under every layout the 2 cores allow (tp1, tp2, pp2, dp2, tp2×pp2 on 4
  ranks) matches one FSDP2 rank over 3 steps; its checkpoint resumes bitwise under the same
  layout and resharded under another; every transport is bitwise after a push from tp2×pp2;
  an MoE model (GLM4-MoE shape: a dense first layer, shared expert, sigmoid routing) trains the
  same with its experts split over 2 ranks (ep=2) as on one, and as FSDP2 trains it, and every
  transport is bitwise after a push from the ep=2 trainer.
  These share FSDP2's launches (one per world size, `tests/scripts/trainer_parity.py`);
- `miles train` on two ranks, fully async, pushes its shards to an engine server (p2p, bf16),
  and an agentic run trains on two ranks as on one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "scripts" / "trainer_parity.py"


CONFIGS = [
    {},
    # (Adam amplifies reduction-order noise in near-zero gradients by lr/eps, so the second case
    # runs at the default lr; a wrong normalisation shows in loss and grad_norm, compared below)
    {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "entropy_coef": 0.01, "lr": 1e-3},
    # an agentic batch: 15 rows (odd: the second rank gets a row that trains nothing), rollouts
    # of 3 leaves each, one of them split across the two ranks
    {"rows": 15, "leaves": 3, "loss_agg": "rollout_mean_token_mean", "lr": 1e-3},
    # LoRA adapters on every linear layer and the output layer: FSDP2 shards them with the frozen
    # base (the weights compared are the adapters')
    {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}},
]
CONFIG_IDS = ["token_mean", "seq_mean+kl+entropy", "odd_rows+rollout_mean", "lora"]
LORA_CASE = CONFIG_IDS.index("lora")


def _run(nproc: int, model_dir: Path, out: Path, configs: list[dict]) -> list[tuple[dict, dict]]:
    """One launch of `nproc` ranks that trains every config of `configs` in turn: torchrun for
    several, the script itself for one (a one-rank group of its own, no launcher agent)."""
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    launcher = [*torchrun, f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_DIST_TIMEOUT_S": "120"}
    proc = subprocess.run(
        [*launcher, str(SCRIPT), str(model_dir), str(out), json.dumps(configs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        (load_file(f"{out}-{i}.safetensors"), json.loads(Path(f"{out}-{i}.json").read_text()))
        for i in range(len(configs))
    ]


STEPS, LR = 3, 1e-2  # the Megatron comparisons: 3 optimizer steps at lr 1e-2, with a KL to
# the reference model and an entropy bonus (the reference pass and the entropy's gradient too)
MEGATRON_LOSS = {"kl_coef": 0.1, "entropy_coef": 0.01}
MEGATRON_LAYOUTS = {  # name: (ranks, train.parallel)
    "tp1": (1, {}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "dp2": (2, {}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2}),
}


def _megatron_configs(
    world: int, out: Path, first: int, ckpt: str, moe: Path
) -> list[tuple[str, dict]]:
    """(name, config) of the Megatron runs of a launch of `world` ranks whose results start at
    index `first`: the FSDP2 reference (one rank), every layout of this size, and on two ranks a
    checkpoint after 2 steps (tp2) resumed for the third as tp2 and as pp2; on four, the pushes
    through every transport after the parity steps. The MoE model `moe`: FSDP2 and Megatron on
    one rank, Megatron with ep=2 on two (then its pushes through every transport)."""
    common = {"steps": STEPS, "lr": LR, **MEGATRON_LOSS}
    moe_runs = {
        1: [
            ("moe_fsdp", common | {"model": str(moe)}),
            ("moe_ep1", common | {"model": str(moe), "backend": "megatron"}),
        ],
        2: [
            (
                "moe_ep2",
                common
                | {"model": str(moe), "backend": "megatron", "parallel": {"ep": 2}, "push": True},
            ),
        ],
    }
    runs = [
        (name, common | {"backend": "megatron", "parallel": parallel})
        for name, (ranks, parallel) in MEGATRON_LAYOUTS.items()
        if ranks == world
    ]
    if world == 1:
        runs.insert(0, ("fsdp", common))
    if world == 2:
        saved = f"{out}-{first + len(runs)}.json"  # its old log-probs: those of the resumes
        tp2, pp2 = {"backend": "megatron", "parallel": {"tp": 2}}, {"parallel": {"pp": 2}}
        runs += [
            ("save", common | tp2 | {"steps": 2, "save": ckpt}),
            ("resume_tp2", common | tp2 | {"steps": 1, "load": ckpt, "old_from": saved}),
            ("resume_pp2", common | tp2 | pp2 | {"steps": 1, "load": ckpt, "old_from": saved}),
        ]
    if world == 4:
        runs[0][1]["push"] = True
    return runs + moe_runs.get(world, [])


NVFP4 = {"format": "nvfp4", "options": {}, "keep_bf16": {"modules": ["lm_head", "router"]}}


@pytest.fixture(scope="module")
def parity_runs(tiny_dir, tmp_path_factory):
    """Every FSDP2 loss config on 1 rank and on 2 ranks, and the Megatron runs, in one launch
    per world size: (FSDP2 one rank, FSDP2 two ranks, {Megatron run name: result})."""
    from miles_core.models import build_model, save_hf_dir

    tmp = tmp_path_factory.mktemp("parity")
    ckpt = str(tmp / "ckpt")
    moe = save_hf_dir(*build_model("tiny-moe-shared", seed=1), tmp / "moe")
    fsdp, megatron = [], {}
    for world, out in ((1, tmp / "one"), (2, tmp / "two"), (4, tmp / "four")):
        plain = [dict(c) for c in CONFIGS] if world < 4 else []
        if world == 2:  # after its steps, a p2p push of its NVFP4 weights, each rank its rows
            plain[0]["push_quantized"] = NVFP4
            plain[LORA_CASE]["push"] = True  # the adapters through every transport
        extra = _megatron_configs(world, out, len(plain), ckpt, moe)
        results = _run(world, tiny_dir, out, [*plain, *(c for _, c in extra)])
        fsdp.append(results[: len(plain)])
        megatron.update(zip((n for n, _ in extra), results[len(plain) :], strict=True))
    return fsdp[0], fsdp[1], megatron


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CONFIGS)), ids=CONFIG_IDS)
def test_two_rank_step_matches_one_rank(parity_runs, case):
    overrides = CONFIGS[case]
    (w1, r1), (w2, r2) = parity_runs[0][case], parity_runs[1][case]  # FSDP2: 1 and 2 ranks
    assert set(w1) == set(w2)
    # Adam's first steps move every weight by ≈ lr·sign(grad), so a gradient that is zero up to
    # reduction-order noise (1 rank vs 2) may flip its sign: such elements may differ by up to
    # 2·lr per step, and must stay rare. Everything else agrees to 1e-5; the loss and grad-norm
    # checks below catch a wrong normalisation (which Adam's scale invariance would hide here).
    lr = overrides.get("lr", 1e-2)
    total = sum(t.numel() for t in w1.values())
    off = 0
    for name in w1:
        diff = (w1[name] - w2[name]).abs()
        assert diff.max() <= 2 * 2 * lr + 1e-6, name
        off += int((diff > 1e-5).sum())
    assert off <= 1e-4 * total, f"{off} of {total} weights differ by more than 1e-5"
    for m1, m2 in zip(r1["metrics"], r2["metrics"], strict=True):
        for key in ("loss", "pg_loss", "ppo_kl", "pg_clipfrac", "entropy", "grad_norm"):
            assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    # the batch really moved the weights, so the comparison is not vacuous
    assert r1["metrics"][1]["ppo_kl"] != 0.0
    flat1 = [x for row in r1["old_log_probs"] for x in row]
    flat2 = [x for row in r2["old_log_probs"] for x in row]
    assert max(abs(a - b) for a, b in zip(flat1, flat2, strict=True)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_megatron_matches_fsdp(parity_runs, layout):
    """Per-token log-probs, loss and grad norm within 1e-5 of FSDP2 at each of 3 steps; the
    weights after them within FSDP's multi-rank tolerance per element (Adam moves a weight by
    at most ≈2·lr per step, even for a near-zero gradient whose sign rounding flips). Megatron
    computes q/k/v and gate/up in fused matmuls, so its logits differ from HF's by ~1e-7, and
    Adam turns that into flips on a few near-zero gradients: at most 1e-3 of the weights move
    by more than 1e-5 (FSDP on two ranks runs HF's arithmetic: none)."""
    runs = parity_runs[2]
    (w_ref, r_ref), (w, r) = runs["fsdp"], runs[layout]
    assert set(w) == set(w_ref)
    total = sum(t.numel() for t in w_ref.values())
    off = 0
    for name in w_ref:
        diff = (w[name] - w_ref[name]).abs()
        assert diff.max() <= 2 * STEPS * LR, name
        off += int((diff > 1e-5).sum())
    assert off <= 1e-3 * total, f"{off} of {total} weights differ by more than 1e-5"
    for m_ref, m in zip(r_ref["metrics"], r["metrics"], strict=True):
        for key in ("loss", "pg_loss", "ppo_kl", "kl_loss", "entropy", "grad_norm"):
            assert m[key] == pytest.approx(m_ref[key], abs=1e-5), key
    assert r_ref["metrics"][1]["ppo_kl"] != 0.0  # the steps moved the weights
    flat_ref = [x for row in r_ref["old_log_probs"] for x in row]
    flat = [x for row in r["old_log_probs"] for x in row]
    assert max(abs(a - b) for a, b in zip(flat, flat_ref, strict=True)) < 1e-5


@pytest.mark.slow
def test_a_checkpoint_resumes_bitwise_and_reshards_to_another_layout(parity_runs):
    """2 steps, save (dist-checkpointing: model and optimizer shards), resume for the third:
    the same layout gives the uninterrupted run's weights bit for bit; pipeline stages instead
    of tensor shards load the same checkpoint (resharded) and agree to rounding."""
    runs = parity_runs[2]
    uninterrupted, _ = runs["tp2"]
    same, _ = runs["resume_tp2"]
    other, _ = runs["resume_pp2"]
    for name, t in uninterrupted.items():
        assert torch.equal(same[name], t), name
        assert (other[name] - t).abs().max() < 1e-5, name


@pytest.mark.slow
def test_an_moe_model_trains_the_same_with_its_experts_on_two_ranks(parity_runs):
    """tiny-moe-shared (a dense first layer, then sigmoid top-2 of 8 experts chosen with a
    correction bias, and a shared expert), 3 steps: Megatron with ep=2 (each rank 4 experts of
    every MoE layer, and half the batch) against Megatron on one rank, and Megatron against
    FSDP2 on one rank (the HF modules): per-token log-probs, loss and the other metrics within
    1e-5 at every step; the grad norm (ep=2 vs 1) within fp32 rounding of a sum over the
    batch's tokens taken in another order (relative eps32 × tokens), against FSDP2 within 1e-4
    of itself (Megatron routes by the top-k of the scores, HF renormalises the softmax over all
    of them, a few 1e-7 apart); the weights: none further apart than Adam can move them, each
    tensor's median within 1e-5."""
    runs = parity_runs[2]

    def compare(name: str, ref: str, grad_norm_rel: float) -> None:
        (w_ref, r_ref), (w, r) = runs[ref], runs[name]
        assert set(w) == set(w_ref) and any(".mlp.experts." in n for n in w), name
        for n in w_ref:
            # Adam's first step moves each weight by lr·sign(g): a gradient within rounding of
            # zero (an expert's weights that few tokens reach) may turn either way, up to 2·lr
            # a step; how many there are is the model's and the batch's, not a fixed share. So:
            # none beyond that bound, and the typical element (the median) within 1e-5 — a
            # wrong mapping (an expert's rows swapped, a transposed projection) moves the median
            diff = (w[n] - w_ref[n]).abs()
            assert diff.max() <= 2 * STEPS * LR, (name, n)
            assert diff.median() <= 1e-5, (name, n, float(diff.median()))
        for m_ref, m in zip(r_ref["metrics"], r["metrics"], strict=True):
            for key in ("loss", "pg_loss", "ppo_kl", "kl_loss", "entropy"):
                assert m[key] == pytest.approx(m_ref[key], abs=1e-5), (name, key)
        flat_ref = [x for row in r_ref["old_log_probs"] for x in row]
        flat = [x for row in r["old_log_probs"] for x in row]
        # each gradient element is a sum over the batch's tokens, summed in another order on
        # two ranks: fp32 rounding bounds the relative change by eps32 × the reduction length
        reordered = torch.finfo(torch.float32).eps * len(flat_ref)
        for m_ref, m in zip(r_ref["metrics"], r["metrics"], strict=True):
            assert m["grad_norm"] == pytest.approx(
                m_ref["grad_norm"], rel=max(grad_norm_rel, reordered)
            ), name
        assert max(abs(a - b) for a, b in zip(flat, flat_ref, strict=True)) < 1e-5, name
        assert r_ref["metrics"][1]["ppo_kl"] != 0.0

    compare("moe_ep2", "moe_ep1", grad_norm_rel=0.0)
    compare("moe_ep1", "moe_fsdp", grad_norm_rel=1e-4)
    # the ep=2 trainer's pushes: each rank sends its own experts' rows (p2p) or rank 0
    # gathers them; the engine holds exactly the trainer's weights after each push
    assert runs["moe_ep2"][1]["pushes"] == {
        k: True for k in ("colocated", "shared_memory", "disk", "broadcast", "p2p", "p2p_bf16")
    }


@pytest.mark.slow
def test_every_transport_is_bitwise_after_a_push_from_tp2_pp2(parity_runs):
    """After its parity steps the tp2×pp2 trainer (4 ranks) pushes through every transport, a
    step before each: the engine holds exactly the trainer's weights after each push
    (`tests/scripts/trainer_parity.py: push_through_transports`)."""
    pushes = parity_runs[2]["tp2xpp2"][1]["pushes"]
    assert pushes == {
        k: True for k in ("colocated", "shared_memory", "disk", "broadcast", "p2p", "p2p_bf16")
    }


def _overrides(tmp_path: Path, name: str, world: int, extra: tuple) -> list[str]:
    return [
        f"name={name}",
        "model.preset=tiny",
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=4",
        "train.num_steps=2",  # step 0 compared with one rank; a push between the two
        "train.global_batch_size=32",
        "train.micro_batch_size=8",
        f"train.world_size={world}",
        "weight_sync.check_equal=true",  # bitwise engine == trainer after every push
        f"checkpoint.root={tmp_path}/ckpt",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        *extra,
    ]


def _cli_run(
    tmp_path: Path, api: str, world: int, extra: tuple, overrides=None
) -> dict[str, list[float]]:
    """`miles train` (flows.cli) as a subprocess against the session's Prefect server."""
    from mlflow.tracking import MlflowClient

    name = f"cli-{world}"
    cmd = [sys.executable, "-m", "flows.cli", "train", "--no-progress"]
    for a in (overrides or _overrides)(tmp_path, name, world, extra):
        cmd += ["--set", a]
    env = {**os.environ, "PREFECT_API_URL": api}  # no ephemeral server per run
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs(
        [client.get_experiment_by_name("miles").experiment_id], f"tags.mlflow.runName = '{name}'"
    )[0]
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm")
    return {k: [m.value for m in client.get_metric_history(run.info.run_id, k)] for k in keys}


def _first_step_on_one_rank(tmp_path: Path, extra: tuple, overrides=None) -> dict[str, float]:
    """Step 0 of the same run on one rank, in process (no flow, no tracking)."""
    from miles_core.config import load_config
    from miles_core.run.runtime import RLRuntime, prepare_model_dir

    config = load_config(None, (overrides or _overrides)(tmp_path / "one", "one", 1, extra))
    runtime = RLRuntime(config, prepare_model_dir(config, tmp_path / "one"), None)
    try:
        result = runtime.rollout(0)
        return {"rollout/reward_mean": result.metrics["rollout/reward_mean"]} | runtime.train(
            result
        )
    finally:
        runtime.close()


SERVER = ("rollout.engine=server", "rollout.engine_options.threads=1")
P2P_ASYNC = ("weight_sync.transport=p2p", "weight_sync.dtype=bfloat16", "rollout.mode=fully_async")


def _agentic_overrides(tmp_path: Path, name: str, world: int, extra: tuple) -> list[str]:
    """`_overrides`, then an agentic run's settings over them (later overrides win)."""
    agentic = (
        "data.task=terminal",
        "data.num_prompts=16",
        *SERVER,
        "agent.function=miles_core.envs.sandbox_agent:run_agent",
        "agent.max_turns=3",  # what the suite's scripted solutions need (preflight)
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.loss_options.loss_agg=rollout_mean_token_mean",
    )
    return _overrides(tmp_path, name, world, (*agentic, *extra))


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_an_agentic_run_on_two_ranks_pushes_shards_and_trains_as_on_one(prefect_server, tmp_path):
    """`miles train` with train.world_size=2 re-launches under torchrun; rank 0 runs the flow in
    fully async mode with agent episodes in sandboxes through the session server, and the two
    trainer ranks push bf16 weights to the engine server with p2p, each rank its own FSDP shard
    (no gather: the shard path). weight_sync.check_equal compares the engine's checksum with the
    trainer's (in the push dtype) after every push. Step 0 (episodes of the initial weights, in
    the data order and seeds of a sync run) has the loss and gradient norm of the same step on
    one rank: the multi-rank driver splits the batch and averages as one rank does. (The
    gathered path on 2 ranks, `named_weights`, is test_two_rank_step_matches_one_rank's; every
    gathered transport is tested on one rank in test_flow.py.)"""
    two = _cli_run(tmp_path, prefect_server, 2, P2P_ASYNC, _agentic_overrides)
    assert len(two["train/loss"]) == 2
    one = _first_step_on_one_rank(tmp_path, P2P_ASYNC[:2], _agentic_overrides)  # sync, one rank
    assert two["rollout/reward_mean"][0] == one["rollout/reward_mean"]
    assert two["train/loss"][0] == pytest.approx(one["train/loss"], abs=1e-5)
    assert two["train/grad_norm"][0] == pytest.approx(one["train/grad_norm"], abs=1e-5)


@pytest.mark.slow
def test_two_fsdp_ranks_train_lora_adapters_and_push_them_alone(parity_runs):
    """LoRA on two FSDP2 ranks (the adapters sharded with the frozen base): the pushes carry
    the adapters alone, and every transport lands them bitwise (p2p: each rank its own rows)."""
    weights, result = parity_runs[1][LORA_CASE]
    assert weights and all(n.startswith("lora.default.") for n in weights)
    assert result["pushes"] and all(result["pushes"].values()), result["pushes"]


@pytest.mark.slow
def test_two_fsdp_ranks_push_quantized_rows_that_land_as_the_whole_weights(parity_runs):
    """rollout.precision over p2p: each of two FSDP2 ranks quantizes the rows it holds
    (NVFP4's global amax all-reduced, gate and up sharing it); the engine server's bytes are
    the plan's export of the gathered weights. (Fused experts split by expert:
    test_precision_plan.py, on simulated ranks.)"""
    _, two, _ = parity_runs
    assert two[0][1]["quantized_p2p"] is True
