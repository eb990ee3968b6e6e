"""Runs placed by Ray (`cluster.backend: ray`) on a local Ray cluster started once for this
module (`tests/ray_cluster.py`: 4 logical GPUs on CPUs). The placement group's bundles are ordered
by GPU; a run asking for more GPUs than the cluster declares, or whose group never becomes
ready, fails naming the counts; a local say_a run (torchrun ranks, subprocess engines) resumed
on 2 Ray-placed trainer ranks and 2 engine actors gives the local run's next step bitwise; a
killed engine actor of 2 behind the router is replaced with the current weights and every sample
is trained once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from miles_core.config import load_config
from miles_core.processes.ports import free_port
from tests.ray_cluster import local_ray_cluster


def _ray(address: str, *extra: str) -> list[str]:
    return ["cluster.backend=ray", f"cluster.backend_options.address={address}", *extra]


def test_an_unreachable_ray_address_is_refused_before_anything_starts(tmp_path):
    from miles_core.run.preflight import preflight

    port = free_port()  # nothing listens there
    config = load_config(None, [*_ray(f"127.0.0.1:{port}"), f"checkpoint.root={tmp_path}/c"])
    with pytest.raises(ValueError, match=f"127.0.0.1:{port}: no Ray cluster answers there"):
        preflight(config)
    assert not (tmp_path / "c").exists()


def test_ray_settings_are_checked_at_config_time():
    with pytest.raises(ValidationError, match="address"):
        load_config(None, ["cluster.backend=ray"])
    with pytest.raises(ValidationError, match="does not run an SFT warm start"):
        load_config(None, [*_ray("127.0.0.1:6379"), "sft.task=reverse"])
    with pytest.raises(ValidationError, match="unknown cluster backend 'slurm'"):
        load_config(None, ["cluster.backend=slurm"])


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(gpus=4, cpus=8) as address:
        yield address


@pytest.mark.slow
def test_bundles_follow_the_gpus_and_what_cannot_be_placed_fails_clearly(ray_address):
    import ray
    from ray.util.placement_group import remove_placement_group

    from miles_core.cluster.ray.connect import connect
    from miles_core.cluster.ray.placement_group import create
    from miles_core.plan.placement import Layout

    connect(ray_address)
    layout = Layout(train=2, engines=2, per_engine=1, colocate=False)
    pg, order = create(layout, 60, ray_address)
    try:
        assert sorted(order) == [0, 1, 2, 3] and layout.engine_bundles(1) == [3]
        with pytest.raises(ValueError, match=r"needs 6 GPUs \(4 trainer rank\(s\) and 2 engine"):
            create(Layout(4, 2, 1, False), 5, ray_address)
        with pytest.raises(ValueError, match=r"declares 4$"):
            create(Layout(3, 1, 2, False), 5, ray_address)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"not ready after 2 s .* 0 GPUs .* free of 4 GPUs"):
            create(Layout(1, 0, 1, False), 2, ray_address)  # the 4 GPUs are held above
        assert time.monotonic() - t0 < 30
        assert ray.available_resources().get("GPU", 0) == 0  # the stuck group was removed
    finally:
        remove_placement_group(pg)


def _say_a(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [
        f"name={name}",
        "model.preset=tiny",
        "data.task=say_a",
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=4",
        "rollout.engine=server",
        "rollout.engine_options.num_engines=2",
        "rollout.engine_options.threads=1",
        "weight_sync.transport=shared_memory",
        "weight_sync.check_equal=true",  # bitwise engines == trainer after every push
        "train.num_steps=2",
        "train.global_batch_size=32",
        "train.micro_batch_size=8",
        "train.lr=3e-3",
        "train.world_size=2",
        "train.threads=1",
        f"checkpoint.root={tmp_path}/ckpt",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        *extra,
    ]


KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/policy_version")


def _train(tmp_path: Path, api: str, sets: list[str], *flags: str) -> dict[str, list[float]]:
    """`miles train` as a subprocess against the session's Prefect server; its metrics, the
    newest value of each step (a resumed run logs the steps after its checkpoint again)."""
    from mlflow.tracking import MlflowClient

    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flows.cli", "train", "--no-progress", *flags]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    assert run.info.status == "FINISHED"
    out = {}
    for key in KEYS:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
        out[key] = list({m.step: m.value for m in history}.values())
    return out


@pytest.mark.slow
def test_say_a_placed_by_ray_is_bitwise_the_local_run(prefect_server, tmp_path, ray_address):
    """A local run (torchrun ranks, subprocess engines, shared memory) of 2 steps, checkpoint
    after each; then the same run resumed from step 0 on Ray: 2 trainer ranks (actors forming
    their gloo group) and 2 engine servers (each started by its actor on a bundle after the
    trainer's), pushing over `p2p` (every trainer actor sends its shards into one process group
    with the engines). Sync mode: the resumed step's rewards, losses and gradient norms are the
    local run's to the bit, and the checkpoint the Ray actors write over the local one holds
    the same weights. Colocated placement is the fully async test's below."""
    from miles_core.checkpoint.store import CheckpointStore

    sets = _say_a(tmp_path, "say-a", "checkpoint.interval=1")
    local = _train(tmp_path, prefect_server, sets)
    assert len(local["train/loss"]) == 2
    store = CheckpointStore(f"{tmp_path}/ckpt", "say-a")
    sha = store.read_state(1)["weights_sha256"]
    placed = [*sets, *_ray(ray_address, "cluster.colocate=false"), "weight_sync.transport=p2p"]
    assert _train(tmp_path, prefect_server, placed, "--resume-step", "0") == local
    assert store.read_state(1)["weights_sha256"] == sha


@pytest.mark.slow
def test_a_killed_engine_actor_is_replaced_and_every_sample_trained_once(tmp_path, ray_address):
    """Fully async, colocated: 2 trainer ranks, 2 engine servers behind the router, each engine
    sharing a trainer rank's bundle. The first engine's actor is killed (`ray.kill`) while
    requests are in flight. Its server exits with it, the supervisor places a new actor on the
    same bundle, which restarts the server on the same port with the trainer's current weights
    and rejoins the router; the router sends the calls it was serving to the other engine, and
    every sample is trained exactly once."""
    import signal

    import ray

    from tests.test_engine_recovery import Saboteur, _check_recovered, _config, _run

    class KillActor(Saboteur):
        def strike(self) -> None:
            ray.kill(self.popen.actor)  # the actor holding the engine server

    cfg = _config(
        tmp_path,
        "rollout.mode=fully_async",
        "rollout.mode_options.max_staleness=1",
        "rollout.engine_options.num_engines=2",
        "train.world_size=2",
        "train.micro_batch_size=4",
        *_ray(ray_address, "cluster.colocate=true"),
    )
    trained, metrics, sup, sab, pids = _run(cfg, signal.SIGKILL, saboteur_class=KillActor)
    _check_recovered(trained, metrics, sup, sab, pids, cfg, routed=True)
