"""The `cluster:` section: where a run's processes run (`cluster.backend`, `cluster/`) and the
GPUs it is laid out on (`miles plan`, `plan/`)."""

from __future__ import annotations

from pydantic import Field

from miles_core.config.base import PluginOptionsField, Strict, options_field, plugin_validators


def _clusters():
    from miles_core.cluster.backend import CLUSTERS

    return CLUSTERS


class ClusterConfig(Strict):
    backend: str = Field(
        "local",
        description="where trainer ranks and engine servers run: local (this machine: torchrun "
        "ranks, subprocesses), ray (actors placed on a Ray cluster), or 'package.module:Class'",
    )
    backend_options: PluginOptionsField = options_field("backend")
    colocate: bool = Field(
        False,
        description="trainer ranks and rollout engines share the same GPUs (taking turns: the "
        "engines release their memory while the trainer steps); off: engines on GPUs of their "
        "own, after the trainer's",
    )
    gpus_per_node: int = Field(8, ge=1, description="GPUs of each node")
    gpu_memory_gb: float = Field(80.0, gt=0, description="memory of each GPU, GB (10^9 bytes)")
    reserved_gb: float = Field(
        5.0,
        ge=0,
        description="of each GPU's memory, what the plan keeps out of its estimates: the CUDA "
        "context, communication buffers, the allocator's fragmentation",
    )

    _backend, _backend_options = plugin_validators("backend", _clusters)
