"""Per-phase step time of the sync RL loop, and the share Prefect + MLflow add.

For each preset (tiny, small) the same config runs twice, side by side in this process:
  1. the `rl-train` Prefect flow (ephemeral Prefect server, MLflow on SQLite): per-phase seconds
     from its own perf/* metrics; orchestration = step wall time − (rollout + train + weight sync),
     i.e. Prefect task machinery + MLflow writes + flow bookkeeping;
  2. the same phases called in a plain Python loop (no Prefect, no MLflow).
Prints a table, then one JSON object as the last line.

    python benchmarks/step_time.py [--steps 12] [--presets tiny,small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import miles_core  # noqa: F401  (env defaults)
from miles_core.config import RunConfig, load_config
from miles_core.runtime import RLRuntime, new_workdir, prepare_model_dir

PHASES = (
    "perf/rollout_time_s",
    "perf/train_time_s",
    "perf/weight_sync_time_s",
    "perf/orchestration_time_s",
)
WARMUP = 2


def bench_config(preset: str, steps: int, workdir: Path) -> RunConfig:
    return load_config(
        None,
        [
            f"name=bench-{preset}",
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


def run_flow(config: RunConfig) -> list[dict[str, float]]:
    from mlflow.tracking import MlflowClient

    from flows.rl_train import rl_train

    rl_train(config)
    client = MlflowClient(config.tracking.tracking_uri)
    exp = client.get_experiment_by_name(config.tracking.experiment)
    run = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{config.name}'")[0]
    keys = (*PHASES, "perf/step_time_s")
    hist = {
        k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in keys
    }
    return [{k: hist[k][s] for k in keys} for s in range(WARMUP, config.train.num_steps)]


def mean(rows: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--presets", default="tiny,small")
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            config = bench_config(preset, args.steps, Path(tmp))
            plain = run_plain(config)
            flow = run_flow(config)
        orch = sum(r["perf/orchestration_time_s"] for r in flow) / sum(
            r["perf/step_time_s"] for r in flow
        )
        results[preset] = {
            "flow_step_s": mean(flow, "perf/step_time_s"),
            "plain_step_s": mean(plain, "perf/step_time_s"),
            "rollout_s": mean(flow, "perf/rollout_time_s"),
            "train_s": mean(flow, "perf/train_time_s"),
            "weight_sync_s": mean(flow, "perf/weight_sync_time_s"),
            "orchestration_s": mean(flow, "perf/orchestration_time_s"),
            "orchestration_share": orch,
            "flow_over_plain": mean(flow, "perf/step_time_s") / mean(plain, "perf/step_time_s"),
        }

    cols = [
        "flow_step_s",
        "plain_step_s",
        "rollout_s",
        "train_s",
        "weight_sync_s",
        "orchestration_s",
        "orchestration_share",
        "flow_over_plain",
    ]
    print(f"{'preset':8}" + "".join(f"{c:>20}" for c in cols))
    for preset, r in results.items():
        print(f"{preset:8}" + "".join(f"{r[c]:>20.4f}" for c in cols))
    print(
        json.dumps(
            {
                "orchestration_share": {
                    p: round(r["orchestration_share"], 4) for p, r in results.items()
                },
                "step_time_s": {p: round(r["flow_step_s"], 4) for p, r in results.items()},
                "plain_step_time_s": {p: round(r["plain_step_s"], 4) for p, r in results.items()},
                "phase_s": {
                    p: {
                        k: round(r[k], 4)
                        for k in ("rollout_s", "train_s", "weight_sync_s", "orchestration_s")
                    }
                    for p, r in results.items()
                },
                "steps_measured": args.steps - WARMUP,
            }
        )
    )


if __name__ == "__main__":
    main()
