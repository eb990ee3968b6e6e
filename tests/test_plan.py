"""`miles plan`: the recipes in examples/plans/ laid out without a GPU. The seeds' 744B case
study is accepted with its layout, memory and placement; what does not divide or fit is refused
naming the constraint."""

import json
from pathlib import Path

import pytest

from flows.cli import main
from miles_core.config import load_config
from miles_core.plan.plan import PlanError, make_plan
from miles_core.plan.report import render

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "plans"
GLM = str(RECIPES / "glm5_744b.yaml")


@pytest.fixture(scope="module")
def glm_plan():
    config = load_config(GLM, [])
    return config, make_plan(config, 64)


def test_the_744b_case_study_is_planned_with_its_layout_memory_and_placement(glm_plan):
    config, plan = glm_plan
    assert round(plan.sizes.total / 1e9) == 744  # the published size, from config.json alone
    assert plan.layout.describe() == "tp=2 × pp=4 × cp=4 × dp=1 (ep=8, etp=1)"
    t, gpu = plan.trainer, plan.gpu_bytes
    # the optimizer state alone exceeds a GPU: the run needs it offloaded, and then fits
    assert t.optimizer > gpu > t.total_offloaded
    p = plan.placement
    assert [b.roles for b in p.bundles[:32]] == [[f"train rank {r}"] for r in range(32)]
    assert (p.engines, p.gpus_per_engine) == (4, 8)
    assert p.engine_bundles(3) == list(range(56, 64))
    assert {b.node for b in p.bundles} == set(range(16))
    assert plan.engine.kv_tokens >= plan.seq_len
    assert any("cp=4" in n for n in plan.notes)  # this version's trainer: cp=1 only
    text = render(plan, config)
    assert "with the optimizer offloaded" in text and "node 15, bundles 60–63" in text


@pytest.mark.parametrize(
    "sets, gpus, constraint",
    [
        (
            ["train.parallel.pp_layers=[20,20,20,20]"],
            64,
            "pp_layers [20, 20, 20, 20] add up to 80, the model has 78 layers",
        ),
        (
            ["rollout.engine_options.tp_size=6", "rollout.engine_options.ep_size=6"],
            62,
            "num_attention_heads (64) is not divisible by tp_size (6)",
        ),
        ([], 60, "the 28 GPUs for rollout do not split into engines of 8 GPUs"),
        ([], 32, "the trainer's ranks and one engine need 40 GPUs"),
        (
            ["train.offload.optimizer=none", "train.offload.dir=null"],
            64,
            "exceeds cluster.gpu_memory_gb (288) less reserved_gb (5); it fits with train.offload",
        ),
        (
            ["train.parallel.ep=16"],
            64,
            "etp × ep = 1 × 16 to divide world / pp = 8",
        ),
    ],
    ids=["layers", "engine-heads", "engine-gpus", "too-few-gpus", "no-offload", "experts"],
)
def test_a_plan_that_does_not_fit_is_refused_naming_the_constraint(sets, gpus, constraint, capsys):
    args = ["plan", "--config", GLM, "--gpus", str(gpus)]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert constraint in err, err


@pytest.mark.parametrize("recipe, published", [("qwen3_0.6b", 0.6), ("qwen3_30b_a3b", 30.5)])
def test_the_one_node_recipes_are_planned(recipe, published, capsys):
    """slime trains Qwen3-30B-A3B on 8 H100s with this layout only with the optimizer state on
    the CPU: the plan refuses it without."""
    assert main(["plan", "--config", str(RECIPES / f"{recipe}.yaml"), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    config = load_config(str(RECIPES / f"{recipe}.yaml"), [])
    plan = make_plan(config, 8)
    assert abs(plan.sizes.total / 1e9 - published) / published < 0.01
    assert plan.placement.colocate and "node 0, bundles 0–7: train ranks 0–7" in out
    fits = plan.trainer.total if plan.offload == "none" else plan.trainer.total_offloaded
    assert fits < plan.gpu_bytes
    if recipe == "qwen3_30b_a3b":
        with pytest.raises(PlanError, match="it fits with train.offload.optimizer"):
            make_plan(
                load_config(str(RECIPES / f"{recipe}.yaml"), ["train.offload.optimizer=none"]), 8
            )


def test_a_plan_needs_a_model_config(tmp_path):
    with pytest.raises(PlanError, match="model.path: the plan needs a model directory"):
        make_plan(load_config(GLM, ["model.path=null"]), 64)
    with pytest.raises(PlanError, match="config.json does not exist"):
        make_plan(load_config(GLM, [f"model.path={tmp_path}"]), 64)
    assert json.loads((RECIPES.parent / "models/glm-5.2/config.json").read_text())


def test_an_engine_expert_split_must_divide_its_gpus():
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide tp_size \(8\)"):
        load_config(GLM, ["rollout.engine_options.ep_size=3"])
