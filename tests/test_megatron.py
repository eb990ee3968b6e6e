"""The Megatron-core backend (`train.backend: megatron`): HF ↔ Megatron conversion and the
layouts and models refused before anything starts. Its multi-rank tests (parity with FSDP2
under every layout, reshardable checkpoints, every transport from tp2×pp2) share their torchrun
launches with FSDP2's, in tests/test_multirank.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config import load_config
from miles_core.models.builder import preset_config
from miles_core.train.backends.megatron import convert


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
    with pytest.raises(
        ValueError, match="'llama' model; the HF ↔ Megatron converter knows .*qwen3"
    ):
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
    ],
    ids=["tp-world", "dp-world"],
)
def test_a_layout_that_does_not_fit_the_world_is_refused(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [*MEGATRON, *sets])


def test_fsdp_refuses_model_parallel_layouts():
    for split in ("train.parallel.tp=2", "train.parallel.ep=2"):
        with pytest.raises(ValueError, match="fsdp is data parallel only"):
            load_config(None, ["train.world_size=2", split])


def test_the_sft_warm_start_shares_the_trainer_layout():
    sets = [*MEGATRON, "train.world_size=2", "train.parallel.tp=2", "sft.batch_size=8"]
    config = load_config(None, [*sets, "sft.micro_batch_size=4"])
    assert (config.sft.world_size, config.sft.parallel.tp) == (2, 2)
    with pytest.raises(ValueError, match="sft.parallel must equal train.parallel"):
        load_config(
            None, [*sets, "sft.micro_batch_size=4", "sft.parallel.pp=2", "sft.parallel.tp=1"]
        )


def test_a_layout_that_does_not_divide_the_model_is_refused_before_start(tmp_path):
    from miles_core.run.preflight import preflight

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
    from miles_core.run.preflight import preflight

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


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_moe_weights_convert_to_megatrons_experts_and_back_bitwise(preset, tmp_path):
    """Each routed expert e is row [e] of HF's fused 3-D expert tensors (gate_up_proj [E, 2I, H]
    is Megatron's local_experts.e.linear_fc1 as is); the router, its correction bias and the
    shared experts map one to one; the dense first layer of GLM4-MoE stays dense."""
    from miles_core.models import build_model, save_hf_dir

    model, tok = build_model(preset, seed=0)
    hf = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    shapes = convert.Shapes.of(model.config.to_dict())
    # transformers saves one tensor per expert and projection: fused back, they are the modules'
    saved = load_file(save_hf_dir(model, tok, tmp_path / "hf") / "model.safetensors")
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in saved)
    fused = convert.fuse_saved_experts(saved)
    assert set(fused) == set(hf) and all(torch.equal(fused[k], v) for k, v in hf.items())
    mc = convert.hf_to_megatron(hf, shapes)
    for i in shapes.moe_layers:
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for e in range(shapes.experts):
            fc1 = mc[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(fc1, hf[p + "mlp.experts.gate_up_proj"][e])
            name = f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"
            assert convert.expert_of(name) == e
            assert convert.hf_pieces(name, shapes, 1, 0) == [(p + "mlp.experts.down_proj", 0, e, 1)]
        assert torch.equal(mc[m + "mlp.router.weight"], hf[p + "mlp.gate.weight"])
    dense = set(range(shapes.layers)) - shapes.moe_layers
    assert all(f"decoder.layers.{i}.mlp.linear_fc1.weight" in mc for i in dense)
    back = convert.megatron_to_hf(mc, shapes)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())
    missing = {k: v for k, v in mc.items() if convert.expert_of(k) != 3}
    with pytest.raises(ValueError, match=r"lack experts \[3\]"):
        convert.megatron_to_hf(missing, shapes)


@pytest.mark.parametrize(
    "preset, sets, message",
    [
        ("tiny-moe", ("train.world_size=2", "train.parallel.tp=2"), r"tp=2 with mixture-of-"),
        (
            "tiny-moe",
            (
                "train.world_size=3",
                "train.parallel.ep=3",
                "train.global_batch_size=12",
                "rollout.prompts_per_step=3",
            ),
            r"8 experts .* by ep \(3\)",
        ),
        ("tiny", ("train.world_size=2", "train.parallel.ep=2"), r"the model has no experts"),
        # layouts Megatron-core takes on GPUs (miles plan), which this version does not train
        ("tiny", ("train.world_size=2", "train.parallel.cp=2"), "context parallelism needs"),
        (
            "small",
            ("train.world_size=2", "train.parallel.pp=2", "train.parallel.pp_layers=[3,1]"),
            "splits the layers evenly",
        ),
    ],
    ids=["tp-moe", "ep-experts", "ep-dense", "cp", "pp-layers"],
)
def test_an_expert_layout_that_does_not_fit_the_model_is_refused_before_start(
    tmp_path, preset, sets, message
):
    from miles_core.run.preflight import preflight

    root = [f"checkpoint.root={tmp_path}/c", f"tracking.tracking_uri=sqlite:///{tmp_path}/m.db"]
    config = load_config(None, [*MEGATRON, *root, f"model.preset={preset}", *sets])
    with pytest.raises(ValueError, match=message):
        preflight(config)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"ep=2: .* etp × ep = 1 × 2 to divide world / pp = 1"):
        load_config(
            None, [*MEGATRON, "train.world_size=2", "train.parallel.pp=2", "train.parallel.ep=2"]
        )
