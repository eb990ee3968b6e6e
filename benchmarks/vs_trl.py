"""A sync RL step of `miles train` against TRL's `GRPOTrainer`, side by side on one model directory.

For each preset (tiny, small, medium) ONE Hugging Face directory is built with our builder
(`build_model` + `save_hf_dir`: a seeded random-init Qwen3 shape and our char tokenizer) and both
frameworks train it on the same task: say_a's prompts (`Task.generate`, data seed 0) rendered with
the directory's chat template, say_a's reward (`Task.score`, called by TRL as a reward function),
4 prompts × 8 samples, 32 new tokens, temperature 1.0, top-p 1, no top-k, GRPO with group-mean/std
advantages, PPO clip 0.2, token-mean loss, no KL (beta 0), AdamW at a constant lr 1e-3, grad-norm
clip 1.0, one optimizer step per rollout batch, seed 0, fp32 on the CPU.

  - TRL: `benchmarks/peers/trl_grpo.py` in the benchmark-only environment `.venv-trl`
    (`make bench-trl` builds it; TRL is a peer, never a dependency of the package), plain HF
    `generate`. It lives under peers/ because every benchmarks/*.py is a benchmark of its own.
  - ours: the real CLI, `miles train --set ...` (the Prefect flow on the ephemeral API server,
    MLflow on SQLite), once per engine in `--engines` (default: `embedded`, the default
    `rollout.engine`, and `serving`).

Runs are interleaved per preset (ours, TRL, ours(serving), then again, `--rounds` times), each a
fresh process. Each side's own per-step timing is used: ours `perf/step_time_s` and its phases
(perf/rollout|train|weight_sync|orchestration_time_s) from MLflow; TRL the wall time between
consecutive `on_step_end` callbacks, split into HF `generate`, scoring (decode, reward,
advantages) and the rest (forward, backward, optimizer, Trainer bookkeeping). s/step is the median
over the timed steps (after `--warmup`) of all rounds. Steps to threshold: the first step k whose
mean reward over steps k-4..k is ≥ `--threshold` (None if the run ends first). Prints a table,
then one JSON object as the last line: `step_time_vs_trl` per preset (ours s/step ÷ TRL s/step,
default engine; `step_time_vs_trl_serving` for the serving engine) and `steps_to_threshold`.

Per-preset runs merge: the results file (`benchmarks/results/vs_trl.json`, or
`$MILES_BENCH_RESULTS_DIR/vs_trl.json`) keeps the presets this invocation did not measure, each
with its own `measured_at`, so `--presets tiny`, `--presets small`, `--presets medium` in turn
(each under 8 minutes on the 2-core machine) give the same file as one run of all three; `--fresh`
drops them.

    make bench-trl                                      # builds .venv-trl, runs all presets
    .venv/bin/python benchmarks/vs_trl.py --presets tiny --rounds 2
    .venv/bin/python benchmarks/vs_trl.py --presets medium --steps medium=12 --engines embedded
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OURS_PHASES = {
    "rollout": "perf/rollout_time_s",
    "train": "perf/train_time_s",
    "weight_sync": "perf/weight_sync_time_s",
    "orchestration": "perf/orchestration_time_s",
}
GENERATE = "perf/rollout_generate_time_s"  # the engine's part of the rollout phase
LENGTH = "rollout/response_len_mean"  # tokens per completion (TRL: completions/mean_length)
TRL_PHASES = ("generate", "score", "optimise")
# a full run (3 presets × 2 rounds × 3 sides) takes ~17 min on the 2-core machine (tiny 5.5, small
# 4.5, medium ~7); ours pays ~20-35 s of process start-up per run, TRL ~6-14 s
DEFAULT_STEPS = {"tiny": 150, "small": 30, "medium": 9}
WORKLOAD = {
    "task": "say_a",
    "prompts_per_step": 4,
    "samples_per_prompt": 8,
    "max_new_tokens": 32,
    "lr": 1e-3,
    "temperature": 1.0,
    "seed": 0,
}


def run_env(prefect_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DO_NOT_TRACK="true",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        HF_HUB_OFFLINE="1",
        PREFECT_HOME=str(prefect_home),  # the benchmark's own Prefect database
        PREFECT_LOGGING_LEVEL=env.get("PREFECT_LOGGING_LEVEL", "WARNING"),
    )
    return env


def build_model_dir(preset: str, directory: Path) -> Path:
    from miles_core.models import build_model, count_parameters, save_hf_dir

    model, tok = build_model(preset, WORKLOAD["seed"])
    save_hf_dir(model, tok, directory)
    (directory / "params.txt").write_text(str(count_parameters(model)))
    return directory


def _subprocess(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> str:
    with log.open("w") as err:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
        )
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])}… exited {proc.returncode}; log {log}:\n{tail}")
    return proc.stdout


def ours_command(
    model_dir: Path, engine: str, steps: int, work: Path, name: str, *extra: str
) -> list[str]:
    """`miles train` on the workload (`extra`: more `key=value` overrides); tracks to
    `work/mlflow.db`."""
    w = WORKLOAD
    overrides = [
        f"name={name}",
        f"seed={w['seed']}",
        f"model.path={model_dir}",
        f"data.task={w['task']}",
        f"rollout.engine={engine}",
        f"rollout.prompts_per_step={w['prompts_per_step']}",
        f"rollout.n_samples_per_prompt={w['samples_per_prompt']}",
        f"rollout.max_new_tokens={w['max_new_tokens']}",
        f"rollout.temperature={w['temperature']}",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"train.num_steps={steps}",
        f"train.global_batch_size={w['prompts_per_step'] * w['samples_per_prompt']}",
        f"train.micro_batch_size={w['prompts_per_step'] * w['samples_per_prompt']}",
        f"train.lr={w['lr']}",
        "train.lr_decay_style=constant",
        "train.lr_warmup_steps=0",
        "train.weight_decay=0.0",
        "train.grad_clip=1.0",
        "train.loss_options.eps_clip=0.2",
        "train.loss_options.loss_agg=token_mean",
        "train.loss_options.kl_coef=0.0",
        "train.loss_options.entropy_coef=0.0",
        f"checkpoint.root={work}/ckpt",
        "checkpoint.interval=0",
        "checkpoint.overwrite=true",
        f"tracking.tracking_uri=sqlite:///{work}/mlflow.db",
        "tracking.experiment=vs-trl",
        "tracking.register_policy=false",
        *extra,
    ]
    cmd = [str(REPO / ".venv/bin/miles"), "train", "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def trl_command(trl_python: Path, model_dir: Path, steps: int, out: Path) -> list[str]:
    """benchmarks/peers/trl_grpo.py on the workload, its per-step records to `out`."""
    w = WORKLOAD
    return [
        str(trl_python),
        str(HERE / "peers" / "trl_grpo.py"),
        f"--model={model_dir}",
        f"--steps={steps}",
        f"--out={out}",
        f"--task={w['task']}",
        f"--seed={w['seed']}",
        f"--prompts-per-step={w['prompts_per_step']}",
        f"--samples={w['samples_per_prompt']}",
        f"--max-new-tokens={w['max_new_tokens']}",
        f"--lr={w['lr']}",
        f"--temperature={w['temperature']}",
    ]


def run_ours(
    model_dir: Path, engine: str, steps: int, work: Path, name: str, env: dict[str, str]
) -> list[dict[str, float]]:
    """One `miles train`; its per-step metrics from MLflow."""
    from mlflow.tracking import MlflowClient

    cmd = ours_command(model_dir, engine, steps, work, name)
    out = _subprocess(cmd, env, work / f"{name}.log", timeout=900)
    run_id = json.loads(out.strip().splitlines()[-1])["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    keys = ("perf/step_time_s", "rollout/reward_mean", LENGTH, GENERATE, *OURS_PHASES.values())
    hist = {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}
    return [
        {
            "step_s": hist["perf/step_time_s"][s],
            "reward": hist["rollout/reward_mean"][s],
            "length": hist[LENGTH][s],
            **{ph: hist[k].get(s, 0.0) for ph, k in OURS_PHASES.items()},
            "rollout_generate": hist[GENERATE].get(s, 0.0),
        }
        for s in range(steps)
    ]


def run_trl(
    trl_python: Path, model_dir: Path, steps: int, work: Path, name: str, env: dict[str, str]
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """One TRL `GRPOTrainer` run (benchmarks/peers/trl_grpo.py in the TRL environment)."""
    out = work / f"{name}.json"
    _subprocess(trl_command(trl_python, model_dir, steps, out), env, work / f"{name}.log", 900)
    record = json.loads(out.read_text())
    rows = []
    for s in record["steps"]:
        step_s = s["step_s"] if s["step_s"] is not None else s["inner_s"]
        rows.append(
            {
                "step_s": step_s,
                "reward": s.get("reward", float("nan")),
                "length": s.get("mean_length", float("nan")),
                "generate": s["generate_s"],
                "score": s["score_s"],
                "optimise": step_s - s["generate_s"] - s["score_s"],
            }
        )
    return rows, {
        "versions": record["versions"],
        "torch_threads": record["torch_threads"],
        "train_wall_s": record["train_wall_s"],  # trainer.train(), all steps: a cross-check
    }


def steps_to_threshold(rewards: list[float], threshold: float, window: int = 5) -> int | None:
    """The first step k (1-based) whose mean reward over steps k-window+1..k is ≥ threshold."""
    for k in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[k - window : k]) >= threshold:
            return k
    return None


def summarise(
    runs: list[list[dict[str, float]]], phases: tuple[str, ...], warmup: int, threshold: float
) -> dict[str, Any]:
    timed = [row for rows in runs for row in rows[warmup:]]
    return {
        "s_per_step": statistics.median(r["step_s"] for r in timed),
        "s_per_step_by_round": [
            round(statistics.median(r["step_s"] for r in rows[warmup:]), 4) for rows in runs
        ],
        "phase_s": {ph: round(statistics.median(r[ph] for r in timed), 4) for ph in phases},
        "steps_to_threshold": [
            steps_to_threshold([r["reward"] for r in rows], threshold) for rows in runs
        ],
        "reward_last5": [
            round(statistics.fmean(r["reward"] for r in rows[-5:]), 4) for rows in runs
        ],
        "timed_steps": len(timed),
        "mean_length": round(statistics.fmean(r["length"] for r in timed), 2),
        "reward_curve": [round(r["reward"], 3) for r in runs[0]],  # round 0 (seeded: all alike)
    }


def measure(preset: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    steps = args.steps[preset]
    model_dir = build_model_dir(preset, work / f"model-{preset}")
    env = run_env(work / "prefect")
    sides = [f"miles_{e}" for e in args.engines] + ["trl"]
    order = [f"miles_{args.engines[0]}", "trl", *(f"miles_{e}" for e in args.engines[1:])]
    runs: dict[str, list[list[dict[str, float]]]] = {s: [] for s in sides}
    trl_info: dict[str, Any] = {}
    trl_wall: list[float] = []
    outside: dict[str, list[float]] = {s: [] for s in sides}
    for rnd in range(args.rounds):
        for side in order:
            t0 = time.perf_counter()
            name = f"{preset}-{side}-{rnd}".replace("_", "-")
            if side == "trl":
                rows, trl_info = run_trl(args.trl_python, model_dir, steps, work, name, env)
                trl_wall.append(round(trl_info["train_wall_s"] / steps, 4))
            else:
                rows = run_ours(model_dir, side.removeprefix("miles_"), steps, work, name, env)
            runs[side].append(rows)
            wall = time.perf_counter() - t0
            # process start, imports, Prefect/MLflow start, model load, final checkpoint, exit
            outside[side].append(round(wall - sum(r["step_s"] for r in rows), 1))
            med = statistics.median(r["step_s"] for r in rows[args.warmup :])
            print(
                f"  {preset} round {rnd} {side:16} {med:.4f} s/step "
                f"({wall:.0f} s wall, load {os.getloadavg()[0]:.2f})",
                file=sys.stderr,
                flush=True,
            )
    out: dict[str, Any] = {
        "params": int((model_dir / "params.txt").read_text()),
        "steps": steps,
        "rounds": args.rounds,
        "measured_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "benchmarks/vs_trl.py", *sys.argv[1:]]),
        "trl": summarise(runs["trl"], TRL_PHASES, args.warmup, args.threshold),
        "trl_versions": trl_info.get("versions"),
        "trl_train_wall_s_per_step_by_round": trl_wall,
    }
    for e in args.engines:
        out[f"miles_{e}"] = summarise(
            runs[f"miles_{e}"], (*OURS_PHASES, "rollout_generate"), args.warmup, args.threshold
        )
    for side in sides:
        out[side]["outside_steps_s_by_round"] = outside[side]
    return out


def result_of(presets: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The recorded object: per-preset details plus the headline ratios derived from them."""

    def ratio(p: dict[str, Any], side: str) -> float | None:
        if side not in p:
            return None
        return round(p[side]["s_per_step"] / p["trl"]["s_per_step"], 3)

    order = [p for p in ("tiny", "small", "medium") if p in presets] + sorted(
        set(presets) - {"tiny", "small", "medium"}
    )
    presets = {p: presets[p] for p in order}
    sides = ["trl", *sorted({k for d in presets.values() for k in d if k.startswith("miles_")})]
    return {
        "step_time_vs_trl": {p: ratio(d, "miles_embedded") for p, d in presets.items()},
        "step_time_vs_trl_serving": {p: ratio(d, "miles_serving") for p, d in presets.items()},
        "s_per_step": {
            p: {s: round(d[s]["s_per_step"], 4) for s in sides if s in d}
            for p, d in presets.items()
        },
        "steps_to_threshold": {
            p: {s: d[s]["steps_to_threshold"] for s in sides if s in d} for p, d in presets.items()
        },
        "threshold": args.threshold,
        "target": 0.8,
        "workload": WORKLOAD,
        "presets": presets,
    }


def print_table(result: dict[str, Any]) -> None:
    hdr = f"{'preset':8}{'side':18}{'s/step':>9}{'× TRL':>7}  {'phases (median s)':52}{'steps→thr':>12}"
    print(hdr)
    for preset, d in result["presets"].items():
        base = d["trl"]["s_per_step"]
        for side in [k for k in d if k == "trl" or k.startswith("miles_")]:
            s = d[side]
            phases = " ".join(f"{k} {v:.3f}" for k, v in s["phase_s"].items())
            thr = ",".join("—" if x is None else str(x) for x in s["steps_to_threshold"])
            print(
                f"{preset:8}{side:18}{s['s_per_step']:>9.4f}{s['s_per_step'] / base:>7.2f}  "
                f"{phases:52}{thr:>12}"
            )


def parse_steps(text: str | None) -> dict[str, int]:
    steps = dict(DEFAULT_STEPS)
    if text:
        for part in text.split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                steps[k.strip()] = int(v)
            else:  # one number for every preset
                steps = {k: int(part) for k in steps}
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small,medium")
    ap.add_argument(
        "--steps",
        default=None,
        help=f"steps per run: N, or preset=N,… (default {DEFAULT_STEPS})",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per preset")
    ap.add_argument("--engines", default="embedded,serving", help="our rollout.engine values")
    ap.add_argument("--warmup", type=int, default=2, help="steps per run left out of s/step")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    ap.add_argument("--fresh", action="store_true", help="do not keep other presets' figures")
    args = ap.parse_args()
    args.steps = parse_steps(args.steps)
    args.engines = [e for e in args.engines.split(",") if e]
    if not args.trl_python.exists():
        sys.exit(f"{args.trl_python} not found: `make bench-trl` builds the TRL environment")

    from record import RESULTS_DIR, record_result  # benchmarks/record.py

    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for preset in args.presets.split(","):
            measured[preset] = measure(preset, args, Path(tmp))
    target = Path(os.environ.get("MILES_BENCH_RESULTS_DIR") or RESULTS_DIR) / "vs_trl.json"
    presets = {}
    if target.exists() and not args.fresh:  # keep the presets this invocation did not measure
        presets = json.loads(target.read_text())["result"].get("presets", {})
    presets.update(measured)
    result = result_of(presets, args)
    print_table(result)
    print(json.dumps(result))
    record_result("vs_trl", result)


if __name__ == "__main__":
    main()
