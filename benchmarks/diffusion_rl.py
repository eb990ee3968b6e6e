"""Diffusion RL on 2 CPU cores: `examples/diffusion_cpu.yaml` run by `miles train` once per seed.

Each run pretrains its small image model from a random init of its seed, then trains it with RL.
The held-out compositional accuracy (`eval/held_out_all`: the share of the held-out scenes'
images that get colour, count, shape and position all right) is read from MLflow at version 0
(the pretrained model) and at the last version. The wall time is what the user waits for: from
starting `miles train` to its exit, pretraining included.

    python benchmarks/diffusion_rl.py                  # seeds 0, 1, 2 (≈ 75 minutes)
    python benchmarks/diffusion_rl.py --seeds 0 --set train.num_steps=50    # a trial

Prints a table, then one JSON object as the last line; the full three-seed run records it
(benchmarks/results/diffusion_rl.json, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/diffusion_cpu.yaml"
ATTRIBUTES = ("colour", "count", "shape", "position", "all")


def run_seed(seed: int, work: Path, sets: list[str]) -> dict:
    """One `miles train` of the example with this seed; its figures from MLflow."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{work}/mlflow.db"
    name = f"diffusion-bench-{seed}"
    overrides = [
        f"seed={seed}",
        f"model.seed={seed}",
        f"name={name}",
        f"checkpoint.root={work / 'ckpt'}",
        "checkpoint.overwrite=true",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment=diffusion-bench",
        *sets,
    ]
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", EXAMPLE]
    cmd += [a for s in overrides for a in ("--set", s)]
    t0 = time.perf_counter()
    log = work / f"seed{seed}.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: miles train exited {done.returncode}; see {log}")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("diffusion-bench")
    run = client.search_runs(
        [experiment.experiment_id], f"attributes.run_name = '{name}'", max_results=1
    )[0]

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    held = {a: history(f"eval/held_out_{a}") for a in ATTRIBUTES}
    diffs = [v for _, v in history("train/log_prob_mean_abs_diff")]
    return {
        "seed": seed,
        "wall_s": wall,
        "held_out": {a: {"first": h[0][1], "last": h[-1][1]} for a, h in held.items()},
        "held_out_all": held["all"],
        "max_log_prob_mean_abs_diff": max(diffs) if diffs else None,
        "mlflow_run_id": run.info.run_id,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", action="append", default=[], help="an override for every run")
    ap.add_argument(
        "--keep", default=None, help="a folder to keep the runs' MLflow store and logs in"
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        runs = [run_seed(s, Path(args.keep).resolve(), args.set) for s in seeds]
    else:
        with tempfile.TemporaryDirectory(prefix="miles-diffusion-bench-") as tmp:
            runs = [run_seed(s, Path(tmp), args.set) for s in seeds]
    print("| seed | held-out all: pretrained → RL | count | shape | position | wall min |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        h = r["held_out"]
        print(
            f"| {r['seed']} | {h['all']['first']:.3f} → {h['all']['last']:.3f} "
            f"| {h['count']['first']:.2f} → {h['count']['last']:.2f} "
            f"| {h['shape']['first']:.2f} → {h['shape']['last']:.2f} "
            f"| {h['position']['first']:.2f} → {h['position']['last']:.2f} "
            f"| {r['wall_s'] / 60:.1f} |"
        )
    from miles_core.config import load_config

    config = load_config(str(REPO / EXAMPLE), args.set)
    result = {
        "example": EXAMPLE,
        "overrides": args.set,
        "loss": config.train.loss,
        "steps": config.train.num_steps,
        "pretrain_steps": config.diffusion.pretrain_steps,
        "images_per_step": config.rollout.prompts_per_step * config.rollout.n_samples_per_prompt,
        "runs": runs,
        "min_gain": min(r["held_out"]["all"]["last"] - r["held_out"]["all"]["first"] for r in runs),
        "max_wall_s": max(r["wall_s"] for r in runs),
    }
    print(json.dumps(result))
    if (len(seeds) < 3 or args.set) and not os.environ.get("MILES_BENCH_RESULTS_DIR"):
        print("a trial (fewer than three seeds, or overrides): not recorded", file=sys.stderr)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("diffusion_rl", result)


if __name__ == "__main__":
    main()
