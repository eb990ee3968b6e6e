"""The cluster-backend protocol: how a run's trainer ranks and engine servers are started.

A backend is a module of `cluster/backends/` registering a `ClusterBackend` subclass
(`@CLUSTERS.register(name)`), or one named by import path; its `Options` are
`cluster.backend_options`. `check(config, options)` runs at preflight, before anything starts;
`start(config, options)` returns the run's `Cluster`, which builds the trainer, starts the engine
servers' processes, and releases everything in `close()`.
"""

from __future__ import annotations

from typing import Any

from miles_core.plugins import NoOptions, PluginOptions, Registry, subclass_of


class Cluster:
    """One run's share of a cluster."""

    def trainer(self, backend: str, kwargs: dict[str, Any]) -> Any:
        """The trainer backend `backend` (a `train.backend` name) built with `kwargs`; its
        public calls behave as the local trainer's."""
        raise NotImplementedError

    def start_process(self, process: Any, engine: int, timeout: float = 120.0) -> Any:
        """Starts the engine server `process` (a `ManagedProcess` not yet started) for engine
        `engine`, healthy within `timeout` s; returns what the supervisor watches (`url`, `pid`,
        `proc`, `start`, `stop`)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class ClusterBackend:
    Options: type[PluginOptions] = NoOptions
    # `train.world_size > 1` runs under torchrun on this machine (rank 0 runs the flow)
    ranks_under_torchrun: bool = False
    # the runs it places: RL ("rl"), with an SFT warm start ("sft"), image runs ("image")
    runs: frozenset[str] = frozenset({"rl"})

    @classmethod
    def check(cls, config: Any, options: Any) -> None:
        """Before anything starts: raises ValueError naming what cannot work."""

    @classmethod
    def start(cls, config: Any, options: Any) -> Cluster:
        raise NotImplementedError


CLUSTERS: Registry[type[ClusterBackend]] = Registry(
    "cluster backend",
    "cluster.backend",
    package="miles_core.cluster.backends",
    example="package.module:ClusterBackend",
    load=subclass_of(ClusterBackend, "cluster backend"),
)


def start_cluster(config: Any) -> Cluster:
    c = config.cluster
    backend = CLUSTERS.get(c.backend)
    return backend.start(config, CLUSTERS.options(c.backend, c.backend_options))
