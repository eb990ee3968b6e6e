"""The parallel layout of a Megatron trainer (`train.parallel`) and the checks it must pass before
anything starts: its sizes multiply to the world size, and the model's heads, query groups,
layers and hidden sizes divide by them. Pure Python (config validation imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor parallel: heads, MLP columns and the vocabulary split across ranks
    pp: int = 1  # pipeline parallel: consecutive layers per stage
    cp: int = 1  # context parallel: the sequence split across ranks
    dp: int = 1  # data parallel: replicas, each on its share of the batch

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        return f"tp={self.tp} × pp={self.pp} × cp={self.cp} × dp={self.dp}"


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
    layout = Layout(tp, pp, cp, dp)
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
    if bad:
        raise ValueError(
            f"train.parallel {layout.describe()} does not fit the model: " + "; ".join(bad)
        )
