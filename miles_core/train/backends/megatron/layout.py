"""The parallel layout of a Megatron trainer (`train.parallel`) and the checks it must pass before
anything starts: its sizes multiply to the world size, and the model's heads, query groups,
layers and hidden sizes divide by them. Pure Python (config validation imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_core.models.check import moe_sizes


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor parallel: heads, MLP columns and the vocabulary split across ranks
    pp: int = 1  # pipeline parallel: consecutive layers per stage
    cp: int = 1  # context parallel: the sequence split across ranks
    dp: int = 1  # data parallel: replicas, each on its share of the batch
    ep: int = 1  # expert parallel: the routed experts split over groups of ep data-parallel ranks

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return f"tp={self.tp} × pp={self.pp} × cp={self.cp} × dp={self.dp}{ep}"


def resolve_layout(parallel: dict[str, Any] | None, world: int) -> Layout:
    """The layout of `train.parallel` on `world` ranks: dp defaults to what the others leave.
    Raises ValueError naming the numbers when they do not multiply to `world`, or cp > 1."""
    p = dict(parallel or {})
    tp, pp, cp = int(p.get("tp") or 1), int(p.get("pp") or 1), int(p.get("cp") or 1)
    model = tp * pp * cp
    if world % model:
        raise ValueError(
            f"train.parallel: tp × pp × cp = {tp} × {pp} × {cp} = {model} does not divide "
            f"train.world_size ({world})"
        )
    dp = int(p["dp"]) if p.get("dp") is not None else world // model
    layout = Layout(tp, pp, cp, dp, int(p.get("ep") or 1))
    if layout.world != world:
        raise ValueError(
            f"train.parallel: {layout.describe()} = {layout.world} ranks, but "
            f"train.world_size is {world}"
        )
    if cp > 1:
        # megatron-core's local attention refuses a context-parallel group: ring attention is
        # TransformerEngine's (TEDotProductAttention), which needs CUDA and is not a dependency
        raise ValueError(
            f"train.parallel.cp={cp}: context parallelism needs TransformerEngine's attention "
            "(CUDA only, not installed); this version trains with cp=1"
        )
    if layout.ep > 1 and layout.dp % layout.ep:
        raise ValueError(
            f"train.parallel.ep={layout.ep}: expert parallelism splits the experts over "
            f"data-parallel ranks, and dp={dp} is not a multiple of it"
        )
    return layout


def check_model_divides(layout: Layout, hf: dict[str, Any]) -> None:
    """The model's shapes split evenly under `layout` (an HF config as a dict). Raises
    ValueError naming every size that does not."""
    heads = int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    layers = int(hf["num_hidden_layers"])
    ffn = int(hf["intermediate_size"])
    bad = []
    for what, size in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", groups),
        ("intermediate_size", ffn),
    ):
        if size % layout.tp:
            bad.append(f"{what} ({size}) is not divisible by tp ({layout.tp})")
    if layers % layout.pp:
        bad.append(f"num_hidden_layers ({layers}) is not divisible by pp ({layout.pp})")
    experts = moe_sizes(hf).get("experts", 0)
    if layout.ep > 1 and not experts:
        bad.append(f"ep={layout.ep} asks for expert parallelism, and the model has no experts")
    elif experts and experts % layout.ep:
        bad.append(f"its {experts} experts per layer are not divisible by ep ({layout.ep})")
    if experts and layout.tp > 1:
        # Megatron's MoE layers under tp > 1 need sequence parallelism (each tensor-parallel
        # rank routes a slice of the tokens); without it every rank would run, and count the
        # gradient of, the same tokens through the experts
        bad.append(
            f"tp={layout.tp} with mixture-of-experts layers (needs sequence parallelism, not "
            "built: split the experts with ep instead)"
        )
    if bad:
        raise ValueError(
            f"train.parallel {layout.describe()} does not fit the model: " + "; ".join(bad)
        )
