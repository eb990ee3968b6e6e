"""The Megatron-core backend (`train.backend: megatron`): HF ↔ Megatron conversion, parity with
FSDP2 under every layout the 2 cores allow (real torchrun ranks over gloo), every weight transport
bitwise after a push from a tensor- and pipeline-parallel trainer, reshardable checkpoints, and
the layouts and models refused before anything starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config import load_config
from miles_core.models.builder import preset_config
from miles_core.train.megatron import convert

SCRIPTS = Path(__file__).parent / "scripts"


def _hf_state(tiny, tied=True):
    model, _ = tiny
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    else:
        sd["lm_head.weight"] = torch.randn_like(sd["model.embed_tokens.weight"])
    cfg = model.config.to_dict() | {"tie_word_embeddings": tied}
    return sd, convert.Shapes.of(cfg)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_megatron_round_trip_is_bitwise_and_shards_split_as_hf_slices(tiny, tied):
    hf, shapes = _hf_state(tiny, tied)
    mc = convert.hf_to_megatron(hf, shapes)
    assert ("output_layer.weight" in mc) == (not tied)
    back = convert.megatron_to_hf(mc, shapes)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    for tp in (2, 4):  # 4: the vocabulary (106) pads to 108, and the kv heads (2) do not split
        if shapes.groups % tp:
            continue
        for name, full in mc.items():
            parts = [convert.tp_shard(name, full, tp, r, shapes) for r in range(tp)]
            whole = convert.tp_unshard(name, parts, shapes)
            assert torch.equal(whole[: full.shape[0]], full), name
            for r, part in enumerate(parts):  # each shard, converted alone: its HF slices
                pieces = convert.to_hf(name, part, shapes, groups=shapes.groups // tp)
                where = convert.hf_pieces(name, shapes, tp, r)
                for (hf_name, local), (plan_name, dim, start, length) in zip(
                    pieces, where, strict=True
                ):
                    assert hf_name == plan_name
                    want = hf[hf_name]
                    length = want.shape[dim] if length < 0 else length
                    assert torch.equal(
                        local.narrow(dim, 0, length), want.narrow(dim, start, length)
                    )


def test_an_unknown_hf_weight_or_architecture_is_refused(tiny):
    hf, shapes = _hf_state(tiny)
    with pytest.raises(ValueError, match="does not know.*mystery"):
        convert.hf_to_megatron(hf | {"model.mystery.weight": torch.zeros(1)}, shapes)
    llama = tiny[0].config.to_dict() | {"model_type": "llama"}
    with pytest.raises(ValueError, match="'llama' model; the HF ↔ Megatron converter knows qwen3"):
        convert.Shapes.of(llama)
    biased = tiny[0].config.to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias"):
        convert.Shapes.of(biased)


MEGATRON = ("train.backend=megatron", "train.global_batch_size=8", "train.micro_batch_size=4")


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ("train.world_size=4", "train.parallel.tp=3"),
            r"tp × pp × cp = 3 × 1 × 1 = 3 does not divide train.world_size \(4\)",
        ),
        (
            ("train.world_size=2", "train.parallel.tp=2", "train.parallel.dp=2"),
            r"tp=2 × pp=1 × cp=1 × dp=2 = 4 ranks, but train.world_size is 2",
        ),
        (("train.world_size=2", "train.parallel.cp=2"), "context parallelism needs"),
    ],
    ids=["tp-world", "dp-world", "cp"],
)
def test_a_layout_that_does_not_fit_the_world_is_refused(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [*MEGATRON, *sets])


def test_fsdp_refuses_model_parallel_layouts():
    with pytest.raises(ValueError, match="fsdp is data parallel only"):
        load_config(None, ["train.world_size=2", "train.parallel.tp=2"])


def test_the_sft_warm_start_shares_the_trainer_layout():
    sets = [*MEGATRON, "train.world_size=2", "train.parallel.tp=2", "sft.batch_size=8"]
    config = load_config(None, [*sets, "sft.micro_batch_size=4"])
    assert (config.sft.world_size, config.sft.parallel.tp) == (2, 2)
    with pytest.raises(ValueError, match="sft.parallel must equal train.parallel"):
        load_config(
            None, [*sets, "sft.micro_batch_size=4", "sft.parallel.pp=2", "sft.parallel.tp=1"]
        )


def test_a_layout_that_does_not_divide_the_model_is_refused_before_start(tmp_path):
    from miles_core.preflight import preflight

    root = [f"checkpoint.root={tmp_path}/c", f"tracking.tracking_uri=sqlite:///{tmp_path}/m.db"]
    config = load_config(  # tiny: 2 layers, 4 heads, 2 kv heads
        None, [*MEGATRON, *root, "train.world_size=4", "train.parallel.tp=4", "model.preset=tiny"]
    )
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) is not divisible by tp \(4\)"):
        preflight(config)
    config = load_config(
        None, [*MEGATRON, *root, "train.world_size=4", "train.parallel.pp=4", "model.preset=tiny"]
    )
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) is not divisible by pp \(4\)"):
        preflight(config)


def test_an_architecture_the_converter_does_not_know_is_refused_before_start(tmp_path):
    from miles_core.preflight import preflight

    hf = preset_config("tiny", 106, 0, 1).to_dict() | {"model_type": "llama"}
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf))
    config = load_config(
        None,
        [
            *MEGATRON,
            f"model.path={model_dir}",
            f"checkpoint.root={tmp_path}/c",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/m.db",
        ],
    )
    with pytest.raises(ValueError, match="'llama' model"):
        preflight(config)


# ------------------------------------------------------------------ multi-rank (torchrun)
STEPS = 3
LR = 1e-2


def _launch(script: str, nproc: int, *args: str, timeout: int = 400) -> None:
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    launcher = [*torchrun, f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_DIST_TIMEOUT_S": "120"}
    proc = subprocess.run(
        [*launcher, str(SCRIPTS / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _parity(nproc: int, model_dir: Path, out: Path, configs: list[dict]) -> list[tuple]:
    _launch("trainer_parity.py", nproc, str(model_dir), str(out), json.dumps(configs))
    return [
        (load_file(f"{out}-{i}.safetensors"), json.loads(Path(f"{out}-{i}.json").read_text()))
        for i in range(len(configs))
    ]


LAYOUTS = {  # name: (ranks, train.parallel)
    "tp1": (1, {}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "dp2": (2, {}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2}),
}


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """FSDP2 on one rank, then Megatron under every layout, 3 steps each on the same batch and
    initial weights: one launch per world size. Two ranks also save a checkpoint after 2 steps
    and resume it, under the same layout and under another (resharded), for the third."""
    tmp = tmp_path_factory.mktemp("megatron")
    common = {"steps": STEPS, "lr": LR}
    by_world: dict[int, list[str]] = {}
    for name, (world, _) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
    out = {}
    ckpt = str(tmp / "ckpt")
    for world, names in sorted(by_world.items()):
        configs = [common | {"backend": "megatron", "parallel": LAYOUTS[n][1]} for n in names]
        if world == 1:
            names, configs = ["fsdp", *names], [common, *configs]
        if world == 2:  # checkpoint after 2 steps (tp2), resume as tp2 and as pp2
            first = str(tmp / f"w{world}") + f"-{len(configs)}.json"
            names += ["save", "resume_tp2", "resume_pp2"]
            configs += [
                common | {"steps": 2, "backend": "megatron", "parallel": {"tp": 2}, "save": ckpt},
                common
                | {
                    "steps": 1,
                    "backend": "megatron",
                    "parallel": {"tp": 2},
                    "load": ckpt,
                    "old_from": first,
                },
                common
                | {
                    "steps": 1,
                    "backend": "megatron",
                    "parallel": {"pp": 2},
                    "load": ckpt,
                    "old_from": first,
                },
            ]
        for name, result in zip(
            names, _parity(world, tiny_dir, tmp / f"w{world}", configs), strict=True
        ):
            out[name] = result
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_matches_fsdp(runs, layout):
    """Per-token log-probs, loss and grad norm within 1e-5 of FSDP2 at each of 3 steps; the
    weights after them within FSDP's multi-rank tolerance per element (Adam moves a weight by
    at most ≈2·lr per step, even for a near-zero gradient whose sign rounding flips). Megatron
    computes q/k/v and gate/up in fused matmuls, so its logits differ from HF's by ~1e-7, and
    Adam turns that into flips on a few near-zero gradients: at most 1e-3 of the weights move
    by more than 1e-5 (FSDP on two ranks runs HF's arithmetic: none)."""
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
        for key in ("loss", "pg_loss", "ppo_kl", "entropy", "grad_norm"):
            assert m[key] == pytest.approx(m_ref[key], abs=1e-5), key
    assert r_ref["metrics"][1]["ppo_kl"] != 0.0  # the steps moved the weights
    flat_ref = [x for row in r_ref["old_log_probs"] for x in row]
    flat = [x for row in r["old_log_probs"] for x in row]
    assert max(abs(a - b) for a, b in zip(flat, flat_ref, strict=True)) < 1e-5


@pytest.mark.slow
def test_a_checkpoint_resumes_bitwise_and_reshards_to_another_layout(runs):
    """2 steps, save (dist-checkpointing: model and optimizer shards), resume for the third:
    the same layout gives the uninterrupted run's weights bit for bit; pipeline stages instead
    of tensor shards load the same checkpoint (resharded) and agree to rounding."""
    uninterrupted, _ = runs["tp2"]
    same, _ = runs["resume_tp2"]
    other, _ = runs["resume_pp2"]
    for name, t in uninterrupted.items():
        assert torch.equal(same[name], t), name
        assert (other[name] - t).abs().max() < 1e-5, name


@pytest.mark.slow
def test_every_transport_is_bitwise_after_a_push_from_tp2_pp2(tiny_dir, tmp_path):
    out = tmp_path / "push.json"
    _launch("megatron_push.py", 4, str(tiny_dir), json.dumps({"tp": 2, "pp": 2}), str(out))
    results = json.loads(out.read_text())
    assert results == {
        k: True for k in ("colocated", "shared_memory", "disk", "broadcast", "p2p", "p2p_bf16")
    }
