"""`ray`: the run's driver (the flow's process) joins a running Ray cluster and places every
trainer rank and engine server as a Ray actor on one placement group of `{GPU: 1, CPU: 1}`
bundles (`cluster/ray/`): colocated (`cluster.colocate`: engines share the trainer's bundles, each
actor holding a fraction of its GPU) or disaggregated (the engines' bundles after the trainer's).
Ray resources are logical: a cluster started with `ray start --head --num-gpus 4` on a machine
without GPUs places the same way, with trainers on gloo."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_core.cluster.backend import CLUSTERS, Cluster, ClusterBackend
from miles_core.plugins import PluginOptions


class RayOptions(PluginOptions):
    address: str = Field(
        description="the Ray cluster to join: HOST:PORT of its head (what `ray start --head` "
        "prints), or 'auto' for the one started on this machine"
    )
    placement_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long the run waits for its placement group's bundles before it fails, "
        "naming what the cluster has",
    )
    actor_timeout_s: float = Field(
        600.0, gt=0, description="how long one trainer call or actor start may take"
    )


@CLUSTERS.register("ray")
class Ray(ClusterBackend):
    Options = RayOptions

    @classmethod
    def check(cls, config: Any, options: RayOptions) -> None:
        from miles_core.cluster.ray.connect import check_reachable

        check_reachable(options.address)

    @classmethod
    def start(cls, config: Any, options: RayOptions) -> Cluster:
        from miles_core.cluster.ray.cluster import RayCluster

        return RayCluster.start(config, options)
