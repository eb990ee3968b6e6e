"""`local`: everything on this machine: trainer ranks under torchrun (rank 0 runs the flow), engine
servers as subprocesses."""

from __future__ import annotations

from typing import Any

from miles_core.cluster.backend import CLUSTERS, Cluster, ClusterBackend


class LocalCluster(Cluster):
    def trainer(self, backend: str, kwargs: dict[str, Any]) -> Any:
        from miles_core.train.backend import BACKENDS

        return BACKENDS.get(backend)(**kwargs)

    def start_process(self, process: Any, engine: int, timeout: float = 120.0) -> Any:
        return process.start(timeout=timeout)


@CLUSTERS.register("local")
class Local(ClusterBackend):
    ranks_under_torchrun = True
    runs = frozenset({"rl", "sft", "image"})

    @classmethod
    def start(cls, config: Any, options: Any) -> Cluster:
        return LocalCluster()
