"""A local Ray cluster for the tests: `ray start --head --block` on 127.0.0.1 with declared
logical GPUs (Ray only counts them: the trainers run on CPUs over gloo), stopped by PID with
every process it started."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from miles_core.processes.identity import children, terminate
from miles_core.processes.ports import free_port


@contextmanager
def local_ray_cluster(gpus: int = 4, cpus: int = 8, start_timeout_s: float = 120.0):
    """Yields the head's address, HOST:PORT."""
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    ray = str(Path(sys.executable).parent / "ray")
    # Ray runs its workers at niceness 15: beside the suite's other worker (niceness 0) on two
    # cores they would get a few percent of a core and take minutes to import torch
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_worker_niceness": "0",
    }
    log = open(temp / "start.log", "wb")  # noqa: SIM115  (closed on the way out)
    proc = subprocess.Popen(
        [
            ray, "start", "--head", "--block", f"--port={port}",
            "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
            "--object-store-memory=200000000",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited {proc.returncode}: see {temp}/start.log")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no Ray head on port {port} after {start_timeout_s} s"
                    ) from None
                time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        import ray as ray_api

        if ray_api.is_initialized():
            ray_api.shutdown()
        left = children(proc.pid)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        terminate(left, timeout=10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
