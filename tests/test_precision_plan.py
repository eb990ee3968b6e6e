"""rollout.precision end to end without a server: the keep-list's two matchers agree, the plan
turns weights into checkpoint tensors and back bit for bit (through safetensors too), an
engine holds exactly what was pushed and computes with its dequantized values, QAT forwards
see those values, and bad settings are refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_core.config import load_config
from miles_core.config.precision import KeepBF16
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.models import build_model
from miles_core.precision import qat
from miles_core.precision.format import build_format, fake_quantize
from miles_core.precision.keep import KeepList, is_linear_weight
from miles_core.precision.plan import QuantPlan
from miles_core.precision.push import QuantizedSource
from miles_core.precision.served import ServedWeights
from miles_core.train.backends.megatron import convert
from miles_core.weights.source import TensorBuckets
from tests.rank_threads import local_rows, on_ranks, row_plan

FORMATS = {
    "fp8": {},
    "fp8_block": {},
    "mxfp8": {},
    "mxfp4": {"scale_rule": "floor"},
    "nvfp4": {},
    "int4": {"group_size": 32},
}


def _plan(fmt: str, layers: int = 2, **keep) -> QuantPlan:
    spec = {"format": fmt, "options": FORMATS.get(fmt, {}), "keep_bf16": KeepBF16(**keep)}
    spec["keep_bf16"] = spec["keep_bf16"].model_dump()
    return QuantPlan.from_spec(spec, layers)


@pytest.fixture(scope="module")
def weights(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(7)
    return {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
            for n, p in model.named_parameters()}  # fmt: skip


KEEPS = [
    {},
    {"modules": ["attention", "dense_mlp"]},
    {"modules": ["router", "lm_head", "attention", "dense_mlp", "shared_experts"]},
    {"modules": [], "first_layers": 1},
    {"modules": ["router"], "last_layers": 1, "names": ["o_proj", "down_proj"]},
]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-moe-shared"])
def test_hf_and_megatron_keep_lists_select_the_same_tensors(preset):
    model, _ = build_model(preset, seed=0)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    shapes = convert.Shapes.of(model.config)
    megatron = convert.hf_to_megatron(hf, shapes)
    for keep in KEEPS:
        rule = KeepList.of(KeepBF16(**keep), shapes.layers)
        for name in megatron:
            held = convert.hf_names(name, shapes)
            by_hf = {rule.keeps_hf(h) for h in held}
            assert len(by_hf) <= 1, f"{name} holds HF tensors kept differently: {held}"
            if held:
                assert rule.keeps_megatron(name, held) == by_hf.pop(), (keep, name)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_export_safetensors_reload_dequantize_is_bitwise(weights, fmt, tmp_path):
    plan = _plan(fmt)
    tensors = plan.export(weights.items())
    assert set(tensors) == set(plan.layout(weights))
    for name, (shape, dtype) in plan.layout(weights).items():
        assert tuple(tensors[name].shape) == shape and tensors[name].dtype == dtype, name
    save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "m.safetensors")
    back = load_file(tmp_path / "m.safetensors")
    for name, w in weights.items():
        if plan.quantized(name, w.shape):
            a, b = plan.dequantize(tensors, name, w.shape), plan.dequantize(back, name, w.shape)
            assert a.view(torch.int32).tolist() == b.view(torch.int32).tolist()
            assert not torch.equal(a, w)  # quantized: not the float weight any more
        else:
            assert torch.equal(back[name], w)


def test_nvfp4_pairs_gate_and_up_across_buckets(weights):
    plan = _plan("nvfp4")
    names = list(weights)
    gate = next(n for n in names if n.endswith("gate_proj.weight"))
    up = gate.replace("gate_proj", "up_proj")
    rest = [n for n in names if n not in (gate, up)]
    split = [[(gate, weights[gate])], [(n, weights[n]) for n in rest], [(up, weights[up])]]
    out = {n: t for b in plan.export_buckets(split) for n, t in b}
    whole = plan.export(weights.items())
    assert out.keys() == whole.keys()
    assert all(torch.equal(out[n].view(-1).view(torch.uint8), whole[n].view(-1).view(torch.uint8))
               for n in out)  # fmt: skip
    g2, u2 = gate.replace("weight", "weight_scale_2"), up.replace("weight", "weight_scale_2")
    assert out[g2].item() == out[u2].item()


@pytest.mark.parametrize(
    ("fmt", "preset"), [(f, "tiny") for f in FORMATS] + [("nvfp4", "tiny-moe"), ("fp8_block", "tiny-moe-shared")]
)  # fmt: skip
def test_an_engine_serves_the_pushed_bytes_and_the_trainer_computes_with_them(fmt, preset):
    """Dense and MoE models (fused 3-D experts pushed as per-expert 2-D weights)."""
    model, tok = build_model(preset, seed=0)
    g = torch.Generator().manual_seed(7)
    weights = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
               for n, p in model.named_parameters()}  # fmt: skip
    spec = {"format": fmt, "options": FORMATS[fmt], "keep_bf16": KeepBF16().model_dump()}
    engine = EmbeddedEngine(model, tok, precision=spec)
    plan = QuantPlan.from_spec(spec, int(model.config.num_hidden_layers))
    source = QuantizedSource(TensorBuckets(weights, per=4), plan)
    for bucket in source.named_weights():
        engine.update_weights_from_tensor(bucket)
    held = engine.named_tensors()
    pushed = plan.export(weights.items())
    assert held.keys() == pushed.keys()
    for n, t in pushed.items():
        assert torch.equal(held[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), n
    engine.weights_checksum()  # parameters == the dequantized parts, or it raises
    # the trainer's QAT forward computes with exactly the engine's parameters
    trainer, _ = build_model(preset, seed=0)
    trainer.load_state_dict(weights, strict=False)
    installed = qat.install(trainer, plan)
    served = dict(model.named_parameters())
    assert set(installed) == {n for n, p in served.items() if plan.quantized(n, p.shape)}
    for name in installed:
        module_name, _, attr = name.rpartition(".")
        value = qat.served_param(trainer.get_submodule(module_name), attr)
        assert torch.equal(value, served[name]), name
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    assert torch.equal(trainer(ids).logits, model(ids).logits)
    if preset != "tiny":  # the experts were quantized per expert, under the saved names
        assert any(".mlp.experts.7." in n for n in pushed)


def test_qat_gradients_pass_straight_through():
    w = torch.randn(4, 32, requires_grad=True)
    fmt = build_format("mxfp4")
    y = fake_quantize(w, fmt)
    assert torch.equal(y, fmt.dequantize(fmt.quantize(w.detach())))
    g = torch.randn(4, 32)
    y.backward(g)
    assert torch.equal(w.grad, g)


def test_a_bad_push_to_a_quantized_engine_changes_nothing(tiny, weights):
    model, tok = build_model("tiny", seed=0)
    plan = _plan("fp8_block")
    served = ServedWeights(dict(model.named_parameters()), plan)
    before = {n: t.clone() for n, t in served.tensors().items()}
    q = "model.layers.0.self_attn.q_proj."
    parts = plan.export(weights.items())
    bad = [
        ([(q + "weight", parts[q + "weight"])], "all its parts"),
        (
            [
                (q + "weight", parts[q + "weight"].float()),
                (q + "weight_scale_inv", parts[q + "weight_scale_inv"]),
            ],
            "pushed torch.float32",
        ),  # fmt: skip
        ([(q + "weight", weights[q + "weight"])], "pushed torch.float32"),
    ]
    for pairs, message in bad:
        with pytest.raises(ValueError, match=message):
            served.load(pairs)
    with pytest.raises(KeyError, match="no parameter"):
        served.load([("model.layers.0.self_attn.q_proj.weight_scale", torch.ones(1))])
    after = served.tensors()
    assert all(torch.equal(after[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
               for n, t in before.items())  # fmt: skip
    assert served.stale() == []


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.qat=true"], "train.qat trains on the values the engine serves"),
        (["rollout.precision=fp8", "rollout.engine=server", "weight_sync.transport=p2p",
          "train.backend=megatron"], "p2p needs train.backend: fsdp"),
        (["rollout.precision=fp8", "train.qat=true", "train.backend=megatron"],
         "megatron backend has no fake-quantized forward"),
        (["rollout.precision=fp8", "train.true_on_policy=true"], "needs train.qat"),
        (["rollout.precision=fp4"], "unknown precision format 'fp4'"),
        (["rollout.precision=int4", "rollout.precision_options.group_size=0"], "greater than 0"),
        (["rollout.precision=fp8", "rollout.precision_options.scale_rule=rceil"], "takes no options"),
    ],
)  # fmt: skip
def test_precision_settings_that_cannot_work_are_refused_naming_them(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, sets)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["rollout.precision=int4"], "group_size 128 does not divide its input dim 64"),
        (["rollout.precision=mxfp8", "precision.keep_bf16.names=[q_prog]"], "'q_prog' names no tensor"),
        (["rollout.precision=fp8", "precision.keep_bf16.modules=[attention,dense_mlp]"],
         "nothing would be quantized"),
        (["rollout.precision=fp8", "precision.keep_bf16.first_layers=3"], "the model has 2 layers"),
    ],
)  # fmt: skip
def test_a_model_the_precision_cannot_take_is_refused_before_start(sets, message):
    from miles_core.run.preflight import _check_precision, _model_config

    config = load_config(None, sets)
    with pytest.raises(ValueError, match=message):
        _check_precision(config, _model_config(config), "model.preset")


def test_only_linear_weights_are_quantizable():
    assert is_linear_weight("model.layers.0.mlp.down_proj.weight", (64, 192))
    assert not is_linear_weight("model.embed_tokens.weight", (106, 64))
    assert not is_linear_weight("model.norm.weight", (64,))
    assert is_linear_weight("model.layers.0.mlp.experts.gate_up_proj", (8, 128, 64))


@pytest.mark.slow
def test_a_qat_run_is_on_policy_and_checkpoints_what_sglang_loads(tmp_path):
    """Two steps of a run with fp8_block rollouts, QAT and true on-policy: the log-prob gap is 0
    at every step, each push passes the bitwise check, and the checkpoint holds the quantized
    copy of its own float weights."""
    from miles_core.precision.convert import QUANTIZED_DIR, read_weights
    from miles_core.run import runtime

    config = load_config(None, [
        "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6",
        "train.global_batch_size=8", "train.micro_batch_size=8", "train.num_steps=2",
        "rollout.precision=fp8_block", "train.qat=true", "train.true_on_policy=true",
        "weight_sync.check_equal=true", f"checkpoint.root={tmp_path / 'ckpt'}",
    ])  # fmt: skip
    rt = runtime.RLRuntime(config, runtime.prepare_model_dir(config, tmp_path / "init"), None)
    try:
        for step in range(2):
            metrics = rt.train(rt.rollout(step))
            assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
            rt.update_weights()
        uri, _, _ = rt.checkpoints.save(1)
    finally:
        rt.close()
    saved = Path(uri)
    qc = json.loads((saved / QUANTIZED_DIR / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128]
    plan = QuantPlan.of(config, 2)
    expected = plan.export(read_weights(saved).items())
    got = read_weights(saved / QUANTIZED_DIR)
    assert all(torch.equal(got[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
               for n, t in expected.items())  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "preset"), [(f, "tiny") for f in FORMATS] + [("nvfp4", "tiny-moe"), ("fp8_block", "tiny-moe-shared")]
)  # fmt: skip
def test_each_rank_quantizing_its_rows_gives_the_whole_weights_bytes(fmt, preset):
    """p2p's quantization (precision/shards.py) on 3 ranks with uneven row shards: the parts
    assembled from the plan are bitwise `export`'s, the whole-weight statistics reduced."""
    from miles_core.precision.shards import quantized_shards

    model, _ = build_model(preset, seed=3)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    plan = _plan(fmt, int(model.config.num_hidden_layers))
    floats = row_plan(weights, 3)

    def send(rank, reduce):
        return quantized_shards(plan, floats, local_rows(weights, floats, rank), rank, reduce)

    results = on_ranks(3, send)
    sent = results[0][0]
    assert [t.to_json() for t in quantized_shards(plan, floats)[0]] == [t.to_json() for t in sent]
    expected = plan.export(weights.items())
    assert [t.name for t in sent] == list(dict.fromkeys(t.name for t in sent))
    assert {t.name for t in sent} == set(expected)
    for i, t in enumerate(sent):
        full = torch.empty(t.shape, dtype=expected[t.name].dtype)
        for p in t.pieces:
            if not p.length:
                continue
            part = results[p.rank][1][i]
            if t.shape:
                full.narrow(p.dim, p.start, p.length).copy_(part)
            else:  # a scalar (NVFP4's weight_scale_2): one piece
                full = part.clone()
        want = expected[t.name]
        assert torch.equal(full.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
            t.name
        )
