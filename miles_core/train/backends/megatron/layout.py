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
    ep: int = 1  # expert parallel: the routed experts split over groups of ep ranks
    etp: int = 1  # expert tensor parallel: each expert's columns split over etp ranks
    pp_layers: tuple[int, ...] | None = None  # layers of each stage; None: an even split

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data parallel: replicas of each expert shard (etp × ep × edp × pp = world)."""
        return self.world // (self.pp * self.ep * self.etp)

    def describe(self) -> str:
        etp = f", etp={self.etp}" if self.etp != self.tp and self.ep > 1 else ""
        ep = f" (ep={self.ep}{etp})" if self.ep > 1 else ""
        return f"tp={self.tp} × pp={self.pp} × cp={self.cp} × dp={self.dp}{ep}"

    def stage_layers(self, layers: int) -> list[int]:
        """How many of the model's `layers` each pipeline stage holds."""
        if self.pp_layers is not None:
            return list(self.pp_layers)
        return [layers // self.pp] * self.pp


def resolve_layout(parallel: dict[str, Any] | None, world: int) -> Layout:
    """The layout of `train.parallel` on `world` ranks, by Megatron-core's rules: dp defaults to
    what tp × pp × cp leave, and the experts' layout (etp × ep × edp × pp = world) fits. Raises
    ValueError naming the numbers when they do not. What this version's trainer cannot run yet
    is `check_buildable`'s (a planned fleet layout may need it)."""
    p = dict(parallel or {})
    tp, pp, cp = int(p.get("tp") or 1), int(p.get("pp") or 1), int(p.get("cp") or 1)
    model = tp * pp * cp
    if world % model:
        raise ValueError(
            f"train.parallel: tp × pp × cp = {tp} × {pp} × {cp} = {model} does not divide "
            f"train.world_size ({world})"
        )
    dp = int(p["dp"]) if p.get("dp") is not None else world // model
    ep = int(p.get("ep") or 1)
    etp = int(p["etp"]) if p.get("etp") is not None else tp
    stages = tuple(int(n) for n in p["pp_layers"]) if p.get("pp_layers") is not None else None
    layout = Layout(tp, pp, cp, dp, ep, etp, stages)
    if layout.world != world:
        raise ValueError(
            f"train.parallel: {layout.describe()} = {layout.world} ranks, but "
            f"train.world_size is {world}"
        )
    if ep > 1 and (world // pp) % (ep * etp):
        raise ValueError(
            f"train.parallel.ep={ep}: the experts' layout etp × ep × edp × pp = world needs "
            f"etp × ep = {etp} × {ep} to divide world / pp = {world // pp}"
        )
    if stages is not None and len(stages) != pp:
        raise ValueError(f"train.parallel.pp_layers has {len(stages)} stages, pp is {pp}")
    return layout


def check_buildable(layout: Layout) -> None:
    """What this version's Megatron trainer runs of the layouts Megatron-core accepts; raises
    ValueError naming what it cannot (a plan for a GPU fleet may still use it)."""
    if layout.cp > 1:
        # megatron-core's local attention refuses a context-parallel group: ring attention is
        # TransformerEngine's (TEDotProductAttention), which needs CUDA and is not a dependency
        raise ValueError(
            f"train.parallel.cp={layout.cp}: context parallelism needs TransformerEngine's "
            "attention (CUDA only, not installed); this version trains with cp=1"
        )
    if layout.ep > 1 and layout.dp % layout.ep:
        raise ValueError(
            f"train.parallel.ep={layout.ep}: this version splits the experts over data-parallel "
            f"ranks, and dp={layout.dp} is not a multiple of it"
        )
    if layout.etp != layout.tp:
        raise ValueError(
            f"train.parallel.etp={layout.etp}: this version splits experts like the rest "
            f"(etp = tp = {layout.tp})"
        )
    if layout.pp_layers is not None and len(set(layout.pp_layers)) > 1:
        raise ValueError(
            f"train.parallel.pp_layers={list(layout.pp_layers)}: this version splits the "
            "layers evenly over the stages"
        )


def fit_problems(layout: Layout, hf: dict[str, Any]) -> list[str]:
    """What of the model (an HF config as a dict) does not split under `layout` by
    Megatron-core's rules, each naming the sizes; empty when everything divides."""
    heads = int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    layers = int(hf["num_hidden_layers"])
    ffn = int(hf.get("intermediate_size") or 0)
    bad = []
    for what, size in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", groups),
        ("intermediate_size", ffn),
    ):
        if size % layout.tp:
            bad.append(f"{what} ({size}) is not divisible by tp ({layout.tp})")
    if layout.pp_layers is not None:
        if sum(layout.pp_layers) != layers:
            bad.append(
                f"pp_layers {list(layout.pp_layers)} add up to {sum(layout.pp_layers)}, "
                f"the model has {layers} layers"
            )
    elif layers % layout.pp:
        bad.append(f"num_hidden_layers ({layers}) is not divisible by pp ({layout.pp})")
    moe = moe_sizes(hf)
    experts = moe.get("experts", 0)
    if layout.ep > 1 and not experts:
        bad.append(f"ep={layout.ep} asks for expert parallelism, and the model has no experts")
    elif experts and experts % layout.ep:
        bad.append(f"its {experts} experts per layer are not divisible by ep ({layout.ep})")
    if experts and moe.get("expert_size", 0) % layout.etp:
        bad.append(
            f"moe_intermediate_size ({moe['expert_size']}) is not divisible by etp ({layout.etp})"
        )
    return bad


def check_model_divides(layout: Layout, hf: dict[str, Any]) -> None:
    """The model's shapes split evenly under `layout` (an HF config as a dict), and this
    version's trainer runs it. Raises ValueError naming every size that does not."""
    bad = fit_problems(layout, hf)
    if moe_sizes(hf).get("experts") and layout.tp > 1:
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
