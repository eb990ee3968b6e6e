"""Per-phase step time of the sync RL loop, and the share Prefect + MLflow add.

For each preset (tiny, small) the same config runs side by side in this process:
  1. the `rl-train` Prefect flow (on the local Prefect server `miles train` uses,
     flows/prefect_server.py; MLflow on SQLite): per-phase seconds from its own perf/* metrics;
     orchestration = step wall time − (rollout + train + weight sync), i.e. Prefect task
     machinery + MLflow writes + flow bookkeeping in the flow's thread; the run's last step,
     which saves a checkpoint, is left out (the plain loop saves none);
  2. the same phases called in a plain Python loop (no Prefect, no MLflow), once before and once
     after the flow, averaged.
Two shares are reported: `orchestration_share` = orchestration / step time inside the flow, and
`overhead_vs_plain` = flow step time / plain step time − 1, which also counts what the Prefect API
server (a process of its own on the same machine) takes from the same two cores; that server's
CPU seconds per step are printed as well. Prints a table, then one JSON object as the last line.

    python benchmarks/step_time.py [--steps 12] [--presets tiny,small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

import miles_core  # noqa: F401  (env defaults)
from miles_core.config import RunConfig, load_config
from miles_core.run.runtime import RLRuntime, new_workdir, prepare_model_dir
from miles_core.run.steplog import PHASES as STEP_PHASES

PHASES = STEP_PHASES[:3]  # rollout, train, weight sync
SERVER: list[psutil.Process] = []  # the Prefect API server whose CPU is counted
CHECKPOINT = STEP_PHASES[3]  # the run's last step saves: left out of the flow's rows
WARMUP = 2


def bench_config(preset: str, steps: int, workdir: Path, name: str) -> RunConfig:
    return load_config(
        None,
        [
            f"name={name}",
            f"model.preset={preset}",
            "data.task=say_a",
            "rollout.prompts_per_step=16",
            "rollout.n_samples_per_prompt=8",
            "rollout.max_new_tokens=16",
            f"train.num_steps={steps}",
            "train.global_batch_size=128",
            "train.micro_batch_size=64",
            f"checkpoint.root={workdir}/ckpt",
            f"tracking.tracking_uri=sqlite:///{workdir}/mlflow.db",
            "tracking.experiment=bench",
            "tracking.register_policy=false",
        ],
    )


def run_plain(config: RunConfig) -> list[dict[str, float]]:
    rt = RLRuntime(config, prepare_model_dir(config, new_workdir()), tracker=None)
    rows = []
    for step in range(config.train.num_steps):
        t0 = time.perf_counter()
        result = rt.rollout(step)
        t1 = time.perf_counter()
        rt.train(result)
        t2 = time.perf_counter()
        rt.update_weights()
        t3 = time.perf_counter()
        rows.append(
            {
                "perf/rollout_time_s": t1 - t0,
                "perf/train_time_s": t2 - t1,
                "perf/weight_sync_time_s": t3 - t2,
                "perf/step_time_s": t3 - t0,
            }
        )
    rt.close()
    return rows[WARMUP:]


def server_cpu_seconds() -> float:
    """user + system CPU seconds of the Prefect API server (psutil)."""
    times = SERVER[0].cpu_times()
    return times.user + times.system


def run_flow(config: RunConfig) -> tuple[list[dict[str, float]], float]:
    """The flow's per-step perf metrics (from MLflow) and the Prefect server's CPU-s per step."""
    from mlflow.tracking import MlflowClient

    from flows.rl_train import rl_train

    cpu0 = server_cpu_seconds()
    rl_train(config)
    server_cpu = server_cpu_seconds() - cpu0
    client = MlflowClient(config.tracking.tracking_uri)
    exp = client.get_experiment_by_name(config.tracking.experiment)
    run = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{config.name}'")[0]
    keys = (*PHASES, "perf/orchestration_time_s", "perf/step_time_s", CHECKPOINT)
    hist = {
        k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in keys
    }
    # a step that saves a checkpoint (the run's last) is left out: the plain loop saves none
    saved = hist.pop(CHECKPOINT)
    steps = [s for s in range(WARMUP, config.train.num_steps) if s not in saved]
    rows = [{k: hist[k][s] for k in keys[:-1]} for s in steps]
    return rows, server_cpu / config.train.num_steps


def mean(rows: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def measure(preset: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        from flows.rl_train import rl_train

        rl_train(bench_config(preset, 1, Path(tmp), "warmup"))
        config = bench_config(preset, steps, Path(tmp), f"bench-{preset}")
        plain = run_plain(config)
        flow, server_cpu = run_flow(config)
        plain += run_plain(config)
    flow_step = mean(flow, "perf/step_time_s")
    plain_step = mean(plain, "perf/step_time_s")
    return {
        "flow_step_s": flow_step,
        "plain_step_s": plain_step,
        "rollout_s": mean(flow, "perf/rollout_time_s"),
        "plain_rollout_s": mean(plain, "perf/rollout_time_s"),
        "train_s": mean(flow, "perf/train_time_s"),
        "plain_train_s": mean(plain, "perf/train_time_s"),
        "weight_sync_s": mean(flow, "perf/weight_sync_time_s"),
        "orchestration_s": mean(flow, "perf/orchestration_time_s"),
        "orchestration_share": sum(r["perf/orchestration_time_s"] for r in flow)
        / sum(r["perf/step_time_s"] for r in flow),
        "overhead_vs_plain": flow_step / plain_step - 1,
        "server_cpu_s": server_cpu,
    }


def main() -> None:
    from flows.prefect_server import use_local_api

    api = use_local_api()  # the Prefect API `miles train` uses (flows/cli.py)
    if api is not None:
        api.wait_ready()
        SERVER.append(psutil.Process(api.record.pid))
    else:  # PREFECT_API_URL: a server elsewhere, its CPU not counted
        SERVER.append(psutil.Process())
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--presets", default="tiny,small")
    args = ap.parse_args()
    results = {preset: measure(preset, args.steps) for preset in args.presets.split(",")}

    cols = list(next(iter(results.values())))
    print(f"{'preset':8}" + "".join(f"{c:>20}" for c in cols))
    for preset, r in results.items():
        print(f"{preset:8}" + "".join(f"{r[c]:>20.4f}" for c in cols))

    def per_preset(key: str) -> dict[str, float]:
        return {p: round(r[key], 4) for p, r in results.items()}

    result = {
        "orchestration_share": per_preset("orchestration_share"),
        "step_time_s": per_preset("flow_step_s"),
        "plain_step_time_s": per_preset("plain_step_s"),
        "overhead_vs_plain": per_preset("overhead_vs_plain"),
        "prefect_server_cpu_s_per_step": per_preset("server_cpu_s"),
        "phase_s": {
            p: {
                k: round(r[k], 4)
                for k in ("rollout_s", "train_s", "weight_sync_s", "orchestration_s")
            }
            for p, r in results.items()
        },
        "steps_measured": args.steps - WARMUP - 1,  # the last one saves a checkpoint
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("step_time", result)


if __name__ == "__main__":
    main()
