"""The `cluster:` section: the GPUs a run is laid out on (`miles plan`, `plan/`)."""

from __future__ import annotations

from pydantic import Field

from miles_core.config.base import Strict


class ClusterConfig(Strict):
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
