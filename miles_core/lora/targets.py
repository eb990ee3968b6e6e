"""Which linear modules an adapter covers (`train.lora.target_modules`, `exclude_modules`).

Names are leaf names (`q_proj`), as peft matches them; `all-linear` is every linear layer of the
decoder layers (as peft's, without the output layer, which is adapted when named: `lm_head`).
The engines serve adapters on the attention and dense MLP projections and on the output layer
(`SERVED`): a target outside them is refused before the run starts, with the modules there are.
(A model whose RMS-normed final state meets a frozen output layer bounds how sharp its
next-token distribution can get; adapting `lm_head` lifts that bound.)"""

from __future__ import annotations

import re

import torch

from miles_core.models.moe import is_moe_layer

# the modules an engine's forward adds an adapter's term to
SERVED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|lm_head"
)
HEAD = "lm_head"


def linear_modules(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """{HF module name: (out features, in features)} of the model's linear layers."""
    return {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def resolve_targets(
    model: torch.nn.Module, targets: list[str] | str, exclude: list[str]
) -> list[str]:
    """The module names the adapter covers. ValueError naming the known leaf names for a
    target or exclusion that matches nothing, or a target the engines cannot serve. On a
    mixture-of-experts model the MLP projections are left out of `all-linear` and refused by
    name: peft re-targets them at the fused experts (its transformers v4 → v5 conversion of
    MoE adapters), which no engine here adapts."""
    linears = linear_modules(model)
    leaves = sorted({n.rpartition(".")[2] for n in linears})
    known = ", ".join(leaves)
    for name in ([] if targets == "all-linear" else list(targets)) + list(exclude):
        if name not in leaves:
            raise ValueError(
                f"train.lora: module {name!r} matches no linear layer of this model; its linear "
                f"layers: {known}"
            )
    moe = any(is_moe_layer(m) for m in model.modules())
    mlp = {"gate_proj", "up_proj", "down_proj"}
    if moe and targets != "all-linear" and mlp & set(targets):
        raise ValueError(
            "train.lora: on a mixture-of-experts model peft adapts the fused experts in place "
            f"of MLP projections ({sorted(mlp & set(targets))}), which the engines do not serve; "
            "adapt the attention projections (q_proj, k_proj, v_proj, o_proj) and lm_head"
        )
    wanted = [n for n in leaves if n != HEAD] if targets == "all-linear" else list(targets)
    if moe:
        wanted = [n for n in wanted if n not in mlp]
    chosen = [
        n for n in linears if n.rpartition(".")[2] in wanted and n.rpartition(".")[2] not in exclude
    ]
    if not chosen:
        raise ValueError("train.lora: target_modules minus exclude_modules leaves no module")
    unserved = [n for n in chosen if not SERVED.fullmatch(n)]
    if unserved and targets != "all-linear":
        raise ValueError(
            f"train.lora: the engines serve adapters on attention (q/k/v/o_proj), dense MLP "
            f"(gate/up/down_proj) and output (lm_head) layers; {unserved[0]!r} is none of them"
        )
    return [n for n in chosen if SERVED.fullmatch(n)]


def leaf_names(modules: list[str]) -> list[str]:
    return sorted({n.rpartition(".")[2] for n in modules})
