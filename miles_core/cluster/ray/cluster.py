"""The run's Ray cluster: the driver joined, one placement group, trainer and engine actors."""

from __future__ import annotations

import logging
from typing import Any

from miles_core.cluster.backend import Cluster
from miles_core.cluster.ray.connect import connect
from miles_core.cluster.ray.engines import EngineHost, PlacedProcess
from miles_core.cluster.ray.placement_group import create
from miles_core.cluster.ray.trainer import RayTrainer, TrainerRank
from miles_core.plan.placement import Layout

log = logging.getLogger("miles")

# fractions of a bundle's GPU, so that a trainer rank and an engine share one when colocated
TRAINER_GPU, ENGINE_GPU = 0.4, 0.2


def run_layout(config: Any) -> Layout:
    from miles_core.engines.registry import ENGINES

    r = config.rollout
    kind = ENGINES.get(r.engine)
    options = kind.Options.model_validate(r.engine_options or {})
    return Layout(
        train=config.train.world_size,
        engines=kind.num_engines(options),
        per_engine=max(1, kind.gpus_per_engine(options)),
        colocate=config.cluster.colocate,
    )


class RayCluster(Cluster):
    def __init__(self, config: Any, options: Any, layout: Layout, pg: Any, order: list[int]):
        self.config = config
        self.options = options
        self.layout = layout
        self.pg = pg
        self.order = order  # run bundle i is placement-group bundle order[i]
        self._ranks: list[Any] = []
        self._inits: list[Any] = []
        self._group: tuple[str, int] = ("", 0)

    @classmethod
    def start(cls, config: Any, options: Any) -> RayCluster:
        connect(options.address)
        layout = run_layout(config)
        pg, order = create(layout, options.placement_timeout_s, options.address)
        log.info(
            "Ray cluster at %s: a placement group of %d {GPU: 1, CPU: 1} bundles for %s",
            options.address,
            layout.total,
            layout.describe(),
        )
        cluster = cls(config, options, layout, pg, order)
        try:
            cluster._launch_ranks()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _on(self, bundle: int, actor_class: type, gpus: float) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            self.pg,
            placement_group_bundle_index=self.order[bundle],
            placement_group_capture_child_tasks=True,
        )
        return ray.remote(actor_class).options(
            num_gpus=gpus, num_cpus=0, scheduling_strategy=strategy
        )

    def _launch_ranks(self) -> None:
        """The trainer ranks' actors, started now and joining their group meanwhile: they
        import torch while the engines start."""
        import ray

        world, timeout = self.layout.train, self.options.actor_timeout_s
        self._ranks = [self._on(r, TrainerRank, TRAINER_GPU).remote({}) for r in range(world)]
        ports = self.config.network.ports
        host, port = ray.get(
            self._ranks[0].address.remote(str(ports) if ports else None), timeout=timeout
        )
        device = self.config.train.device
        self._group = (host, port)
        self._inits = [
            r.init.remote(i, world, host, port, device) for i, r in enumerate(self._ranks)
        ]

    def trainer(self, backend: str, kwargs: dict[str, Any]) -> Any:
        import ray

        from miles_core.token_fields import FIELDS

        world, timeout = self.layout.train, self.options.actor_timeout_s
        ranks = self._ranks
        try:
            ray.get(self._inits, timeout=timeout)
            following = [r.follow.remote() for r in ranks[1:]]
            fields = [f.declaration() for f in FIELDS.values()]
            built = ray.get(ranks[0].build.remote(backend, kwargs, fields), timeout=timeout)
            log.info(
                "trainer: %d rank(s) as Ray actors on bundles %s, group at %s:%d",
                world,
                list(range(world)),
                *self._group,
            )
        except BaseException:
            for r in ranks:
                ray.kill(r)
            raise
        self._ranks = []  # the trainer owns them now
        return RayTrainer(ranks, following, built, timeout)

    def start_process(self, process: Any, engine: int, timeout: float = 120.0) -> Any:
        bundle = self.layout.engine_bundles(engine)[0]
        spawn = lambda: self._on(bundle, EngineHost, ENGINE_GPU).remote({})  # noqa: E731
        log.info("engine %d: starting its server from a Ray actor on bundle %d", engine, bundle)
        return PlacedProcess(process, spawn).launch(timeout)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self._ranks:  # ranks no trainer took over
            ray.kill(r)
        self._ranks = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
