"""`miles convert`'s checkpoints against what SGLang's quantization methods read
(`sglang_quant.json`, extracted from the sglang wheel by `sync_sglang_quant.py`): the method
config.json names is one SGLang registers, the config keys its parser requires are there, the
ignore list is under a key it reads, and every tensor of a quantized weight is a parameter its
linear method registers. The converted bytes are the plan's (what a run's engine serves)."""

import json
from pathlib import Path

import pytest
import torch

from miles_core.config.precision import KeepBF16
from miles_core.precision.convert import LOADABLE, convert_checkpoint, read_weights
from miles_core.precision.plan import QuantPlan, prefix_of

SGLANG = json.loads(Path(__file__).with_name("sglang_quant.json").read_text())
OPTIONS = {"int4": {"group_size": 32}}
# our format → SGLang's method (after its ModelConfig resolves quant_method) and ignore key
METHOD = {
    "fp8": ("fp8", "modules_to_not_convert"),
    "fp8_block": ("fp8", "modules_to_not_convert"),
    "mxfp8": ("fp8", "modules_to_not_convert"),  # SGLang registers mxfp8 → Fp8Config
    "nvfp4": ("modelopt_fp4", "ignore"),
    "int4": ("compressed-tensors", "ignore"),
}


def _plan(fmt: str, **keep) -> QuantPlan:
    spec = {"format": fmt, "options": OPTIONS.get(fmt, {}), "keep_bf16": KeepBF16(**keep)}
    return QuantPlan.from_spec({**spec, "keep_bf16": spec["keep_bf16"].model_dump()}, 2)


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {f: (convert_checkpoint(tiny_dir, root / f, _plan(f)), root / f) for f in LOADABLE}


def test_the_contract_is_for_a_known_sglang():
    assert SGLANG["sglang_version"] == "0.5.23"
    assert {"fp8", "mxfp8", "modelopt", "modelopt_fp4", "compressed-tensors"} <= set(
        SGLANG["methods"]
    )


@pytest.mark.parametrize("fmt", LOADABLE)
def test_sglang_reads_the_converted_config_and_tensor_names(converted, fmt):
    summary, path = converted[fmt]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    method, ignore_key = METHOD[fmt]
    assert qc["quant_method"] in SGLANG["methods"]
    config = SGLANG["configs"][method]
    if method == "modelopt_fp4":  # quant_method modelopt + quant_algo NVFP4 → modelopt_fp4
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] in SGLANG["modelopt_algos"]
        assert "modelopt_fp4" in SGLANG["modelopt_algos"]
        assert {"quant_algo", "group_size", "ignore"} <= set(config["optional_keys"])
        hf_quant = json.loads((path / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["quant_algo"] == "NVFP4"
    else:
        assert set(config["required_keys"]) <= set(qc)
    assert ignore_key in config["optional_keys"] + config["required_keys"]
    assert qc[ignore_key] == ["lm_head"]  # tied: the embedding stays as it is
    tensors = read_weights(path)
    params = set(config["linear_parameters"])
    q = "model.layers.0.self_attn.q_proj."
    ours = {n[len(q) :] for n in tensors if n.startswith(q)}
    assert ours and ours <= params, (ours, params)
    meta = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(meta["weight_map"]) == set(tensors)
    assert meta["metadata"]["total_size"] == summary["bytes"]


@pytest.mark.parametrize("fmt", LOADABLE)
def test_converted_bytes_are_the_bytes_a_run_pushes(converted, tiny_dir, fmt):
    _, path = converted[fmt]
    plan = _plan(fmt)
    source = read_weights(Path(tiny_dir))
    pushed = plan.export(source.items())
    saved = read_weights(path)
    extra = set(saved) - set(pushed)
    assert all(n.endswith("input_scale") for n in extra)  # checkpoint-only (NVFP4)
    for name, t in pushed.items():
        assert torch.equal(saved[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    for name, w in source.items():
        if plan.quantized(name, w.shape):
            assert torch.equal(
                plan.dequantize(saved, name, w.shape), plan.dequantize(pushed, name, w.shape)
            )
            assert prefix_of(name) + "weight" in saved or fmt == "int4"


def test_sglang_mxfp4_has_no_dense_linear_method_so_convert_refuses_it(tiny_dir, tmp_path):
    linear = [m for m in SGLANG["configs"]["mxfp4"]["get_quant_method_returns"] if "Linear" in m]
    assert linear == ["UnquantizedLinearMethod"]
    with pytest.raises(ValueError, match="quantizes MoE experts only"):
        convert_checkpoint(tiny_dir, tmp_path / "out", _plan("mxfp4"))
    assert not (tmp_path / "out").exists()


def test_the_cli_converts_with_a_runs_settings_and_refuses_what_cannot_load(
    tiny_dir, tmp_path, capsys
):
    from flows.cli import main

    args = ["convert", "--to", "int4", "--set", "rollout.precision_options.group_size=32"]
    keep = ["--set", "precision.keep_bf16.first_layers=1"]
    assert main([*args, *keep, str(tiny_dir), str(tmp_path / "int4")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == "int4" and summary["quantized"] == 7  # layer 1 only
    qc = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"]
    assert main(["convert", "--to", "int4", str(tiny_dir), str(tmp_path / "bad")]) == 2
    assert "group_size 128 does not divide" in capsys.readouterr().err
    assert main(["convert", str(tiny_dir), str(tmp_path / "none")]) == 2
    assert "give a format with --to" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "none").exists()
