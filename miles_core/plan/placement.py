"""Which GPU runs what: one bundle per GPU, numbered node by node, trainer ranks first.

Colocated, the engines take the same bundles as the trainer ranks (from bundle 0) and the run
needs as many GPUs as the larger of the two; disaggregated, the engines' bundles come after the
trainer's. Engine e spans bundles [offset + e × g, offset + (e + 1) × g) for g GPUs per engine,
so an engine's tensor-parallel GPUs sit on one node whenever g divides the node's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """How many bundles a run takes and which ones each side gets (`miles plan` prints it,
    `cluster/ray/` places by it)."""

    train: int  # trainer ranks, one bundle each
    engines: int
    per_engine: int  # bundles (GPUs) of one engine
    colocate: bool

    @property
    def total(self) -> int:
        rollout = self.engines * self.per_engine
        return max(self.train, rollout) if self.colocate else self.train + rollout

    def engine_bundles(self, engine: int) -> list[int]:
        offset = 0 if self.colocate else self.train
        g = self.per_engine
        return list(range(offset + engine * g, offset + (engine + 1) * g))

    def describe(self) -> str:
        engines = f"{self.engines} engine(s) × {self.per_engine} GPU(s)"
        how = "sharing the trainer's" if self.colocate else "after the trainer's"
        return f"{self.train} trainer rank(s) and {engines}, {how}"


@dataclass
class Bundle:
    index: int
    node: int
    gpu: int  # on its node
    roles: list[str] = field(default_factory=list)  # "train rank 3", "engine 1 (tp rank 0)"


@dataclass
class Placement:
    bundles: list[Bundle]
    layout: Layout

    @property
    def engines(self) -> int:
        return self.layout.engines

    @property
    def gpus_per_engine(self) -> int:
        return self.layout.per_engine

    @property
    def colocate(self) -> bool:
        return self.layout.colocate

    def engine_bundles(self, engine: int) -> list[int]:
        return self.layout.engine_bundles(engine)


def rollout_gpus(total: int, train_ranks: int, colocate: bool) -> int:
    """The GPUs left to the engines of a run on `total` GPUs."""
    return total if colocate else total - train_ranks


def place(
    total: int, train_ranks: int, gpus_per_engine: int, colocate: bool, gpus_per_node: int
) -> Placement:
    """The bundles of a run on `total` GPUs (checked by `plan.check_counts` first)."""
    engines = (
        rollout_gpus(total, train_ranks, colocate) // gpus_per_engine if gpus_per_engine else 0
    )
    bundles = [Bundle(i, i // gpus_per_node, i % gpus_per_node) for i in range(total)]
    placement = Placement(bundles, Layout(train_ranks, engines, gpus_per_engine, colocate))
    for rank in range(train_ranks):
        bundles[rank].roles.append(f"train rank {rank}")
    for e in range(engines):
        for j, b in enumerate(placement.engine_bundles(e)):
            bundles[b].roles.append(f"engine {e} (tp rank {j})")
    return placement
