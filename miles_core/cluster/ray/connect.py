"""Joining the Ray cluster: its head answers on the address before the run starts anything."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

# the environment every actor of the run gets: no telemetry, no model hub, and Ray leaves
# CUDA_VISIBLE_DEVICES alone (each actor picks its GPU from ray.get_gpu_ids())
ACTOR_ENV = {
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}
PASSED_ON = (
    "DO_NOT_TRACK",
    "HF_HUB_OFFLINE",
    "PREFECT_SERVER_ANALYTICS_ENABLED",
    "MLFLOW_DISABLE_TELEMETRY",
    "MILES_DIST_TIMEOUT_S",
    "PYTHONPATH",
)


def _head(address: str) -> tuple[str, int]:
    if address == "auto":
        current = Path("/tmp/ray/ray_current_cluster")
        found = os.environ.get("RAY_ADDRESS") or (
            current.read_text().strip() if current.exists() else ""
        )
        if not found:
            raise ValueError(
                "cluster.backend_options.address 'auto': no Ray cluster was started on this "
                "machine (start one with `ray start --head`, or give its HOST:PORT)"
            )
        address = found
    if "://" in address:
        raise ValueError(
            f"cluster.backend_options.address {address!r}: give the head's HOST:PORT (the Ray "
            "client protocol, ray://, is not supported: the driver joins the cluster)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"cluster.backend_options.address {address!r}: expected HOST:PORT")
    return host, int(port)


def check_reachable(address: str, timeout_s: float = 5.0) -> str:
    """The head's HOST:PORT; ValueError naming the address when nothing answers there."""
    host, port = _head(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(
            f"cluster.backend_options.address {host}:{port}: no Ray cluster answers there "
            f"({e.strerror or e}); start one with `ray start --head --port {port}` or fix the "
            "address"
        ) from None
    return f"{host}:{port}"


def connect(address: str) -> None:
    """Joins the cluster as a driver (once per process)."""
    import ray

    if ray.is_initialized():
        return
    head = check_reachable(address)
    env = dict(ACTOR_ENV)
    env |= {k: os.environ[k] for k in PASSED_ON if k in os.environ}
    ray.init(
        address=head,
        namespace="miles",
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": env},
    )
