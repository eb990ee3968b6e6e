"""The run's placement group: one `{GPU: 1, CPU: 1}` bundle per GPU, ordered by (node, GPU id).

Ray numbers a group's bundles in the order they were asked for, not by where they landed; a
probe actor in each bundle reports its node and GPU id, and the run uses the bundles sorted by
them, so rank i of the trainer always gets the same physical GPU of a node-ordered fleet.
Waiting is bounded: a group the cluster cannot fill (too few CPUs, GPUs held by another job, an
autoscaler that never adds the node) fails with what the cluster has.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any

from miles_core.plan.placement import Layout

POLL_S = 2.0


def _probe_class():
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> tuple[str, int]:
            ids = ray.get_gpu_ids()
            return ray.util.get_node_ip_address(), int(ids[0]) if ids else -1

    return Probe


def _ip_key(ip: str) -> Any:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def create(layout: Layout, timeout_s: float, address: str) -> tuple[Any, list[int]]:
    """The placement group of `layout` and its bundles' indices in (node, GPU) order."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    need = layout.total
    declared = ray.cluster_resources().get("GPU", 0)
    if declared < need:
        raise ValueError(
            f"the run needs {need} GPUs ({layout.describe()}); the Ray cluster at {address} "
            f"declares {declared:g}"
        )
    pg = placement_group([{"GPU": 1, "CPU": 1}] * need, strategy="PACK")
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _ = ray.wait(
            [pg.ready()], timeout=min(POLL_S, max(0.0, deadline - time.monotonic()))
        )
        if ready:
            break
        if time.monotonic() >= deadline:
            remove_placement_group(pg)
            free = ray.available_resources()
            raise ValueError(
                f"the placement group of {need} {{GPU: 1, CPU: 1}} bundles was not ready after "
                f"{timeout_s:g} s (cluster.backend_options.placement_timeout_s): the cluster at "
                f"{address} has {free.get('GPU', 0):g} GPUs and {free.get('CPU', 0):g} CPUs free "
                f"of {declared:g} GPUs and {ray.cluster_resources().get('CPU', 0):g} CPUs"
            )
    probe = _probe_class()
    probes = [
        probe.options(
            num_gpus=0.01,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(need)
    ]
    try:
        where = ray.get([p.where.remote() for p in probes], timeout=timeout_s)
    finally:
        for p in probes:
            ray.kill(p)
    order = sorted(range(need), key=lambda i: (_ip_key(where[i][0]), where[i][1], i))
    return pg, order
