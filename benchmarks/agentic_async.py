"""Sync vs fully async agentic RL, side by side: the same config (examples/agentic_async_cpu.yaml:
terminal tasks, two engine servers behind sglang-router with session affinity), the same SFT
warm start, the same seeds; only `rollout.mode` differs.

Per variant, over the timed steps (after `--warmup`): steps/s; lag in versions (each trained
sample's staleness: mean of the steps' means, max of their maxes); active episodes against the
in-flight limit `agent.concurrency` (time-weighted over each step's wait for its batch:
`rollout/active_episodes_fraction`); requests running on the engines (summed over both, mean
per engine forward step); the prefix-cache hit rate over both engines (prompt ids found in the
cache / prompt ids) and the session prefix rate (prompt ids that repeat the session's previous
turn: what session affinity can reuse at most, besides prompts shared across sessions); the
machine's CPU busy fraction (on the CPU alone, sync's bounds what overlap can gain: 1 / busy);
median step time; the training success rate (9-step moving average, last value); where an
episode's time goes (its wall time from its in-flight slot, of which waiting for the model and
in the sandbox). Prints a table, then one JSON object; the figures go to
results/agentic_async.json, or results/agentic_async_gpu.json where CUDA is there.

    python benchmarks/agentic_async.py [--steps 24] [--warmup 4] [--sft-steps N | --sft-from DIR]
        [--set KEY=VALUE ...]

The SFT warm start runs once (the example's SFT section, `terminal_detours`) and both variants
start from it: a random model ends every episode at its first reply, which is not the workload
(multi-turn episodes with long-tailed lengths). `--sft-from` takes the model directory of an
earlier `miles sft` on the example instead (`checkpoints/agentic-async-sft/step_000200`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from miles_core.config import load_config
from miles_core.run.runtime import RLRuntime, prepare_model_dir
from miles_core.run.steplog import trailing_mean

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agentic_async_cpu.yaml"


class _NoTracking:
    """What `run_sft` logs to, dropped (the benchmark reports its own figures)."""

    run_id = None

    def log_metrics(self, metrics, step) -> None: ...

    def flush(self) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


def overrides(tmp: Path, args) -> list[str]:
    return [
        f"checkpoint.root={tmp}/ckpt",
        *([f"sft.num_steps={args.sft_steps}"] if args.sft_steps else []),  # else the example's
        f"train.num_steps={args.steps}",
        "agent.eval_episodes=0",  # evaluation is not what is timed
        "agent.eval_every=0",
        "checkpoint.interval=0",
        *args.set,  # --set KEY=VALUE: the example with a change (e.g. agent.concurrency=64)
    ]


def warm_start(tmp: Path, args) -> str:
    """The SFT checkpoint both variants start from."""
    from miles_core.train.sft import run_sft

    cfg = load_config(EXAMPLE, overrides(tmp, args))
    return run_sft(cfg, prepare_model_dir(cfg, tmp / "init"), _NoTracking())


def cpu_busy(before, after) -> float:
    """The fraction of the machine's CPU time that was not idle between two `cpu_times()`."""
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (
        before.idle + getattr(before, "iowait", 0.0)
    )
    total = sum(after) - sum(before)
    return 1.0 - idle / total if total > 0 else 0.0


def run(mode: str, model_uri: str, tmp: Path, args) -> dict:
    cfg = load_config(
        EXAMPLE,
        [
            *overrides(tmp, args),
            f"name=bench-agentic-{mode}",
            f"rollout.mode={mode}",
            "model.context=null",  # the SFT checkpoint keeps its own
            f"model.path={model_uri}",
            f"sft.reuse={model_uri}",  # its examples stay out of the RL prompts (exclude_sft)
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, tmp / f"model-{mode}"), None)
    per_step: list[dict] = []
    t0, cpu0 = 0.0, psutil.cpu_times()
    try:
        for step in range(args.steps):
            if step == args.warmup:
                t0, cpu0 = time.perf_counter(), psutil.cpu_times()
            load0 = rt.engine.load_counters()
            t = time.perf_counter()
            result = rt.rollout(step)
            rt.train(result)
            rt.update_weights()
            m = result.metrics
            load1 = rt.engine.load_counters()
            engine_steps = load1.get("steps", 0.0) - load0.get("steps", 0.0)
            running = (load1.get("running_sum", 0.0) - load0.get("running_sum", 0.0)) / max(
                engine_steps, 1e-9
            )
            per_step.append(
                {
                    "step_s": time.perf_counter() - t,
                    "lag_mean": m.get("rollout/staleness/mean", 0.0),
                    "lag_max": m.get("rollout/staleness/max", 0.0),
                    "active_fraction": m.get("rollout/active_episodes_fraction", 0.0),
                    "active_episodes": m.get("rollout/active_episodes_mean", 0.0),
                    # requests running per engine step, summed over the engines
                    "active_requests": running * cfg.rollout.engine_options.num_engines,
                    "prefix_hit": m.get("engine/prefix_cache_hit_rate", 0.0),
                    "session_prefix": m.get("rollout/session/session_prefix_rate", 0.0),
                    "success": m.get("rollout/success_rate", 0.0),
                    "turns": m.get("agent/turns_mean", 0.0),
                    # where an episode's time goes: waiting for the model, in the sandbox
                    "episode_s": m.get("agent/episode_s_mean", 0.0),
                    "model_s": m.get("agent/model_s_mean", 0.0),
                    "sandbox_s": m.get("agent/sandbox_s_mean", 0.0),
                    "failed": m.get("rollout/failed_episodes", 0.0),
                }
            )
            print(f"{mode} step {step}: {json.dumps(per_step[-1])}", flush=True)
        seconds = time.perf_counter() - t0
        busy = cpu_busy(cpu0, psutil.cpu_times())
    finally:
        rt.close()
    timed = per_step[args.warmup :]

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in timed)

    return {
        "steps_per_s": len(timed) / seconds,
        "median_step_s": statistics.median(s["step_s"] for s in timed),
        "lag_mean": mean("lag_mean"),
        "lag_max": max(s["lag_max"] for s in timed),
        "active_fraction": mean("active_fraction"),
        "active_episodes": mean("active_episodes"),
        "active_requests": mean("active_requests"),
        "prefix_cache_hit_rate": mean("prefix_hit"),
        "session_prefix_rate": mean("session_prefix"),
        "cpu_busy": busy,
        "turns_mean": mean("turns"),
        "episode_s": mean("episode_s"),
        "model_s": mean("model_s"),
        "sandbox_s": mean("sandbox_s"),
        "failed_episodes": sum(s["failed"] for s in per_step),
        "success_ma9_last": trailing_mean(
            list(enumerate(s["success"] for s in per_step)), len(per_step) - 1
        ),
        "success": [round(s["success"], 3) for s in per_step],
        "limit": cfg.agent.concurrency,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=None, help="default: the example's")
    ap.add_argument("--sft-from", type=Path, default=None, help="an earlier SFT's model dir")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    args = ap.parse_args()
    if args.sft_from is not None and not (args.sft_from / "config.json").is_file():
        ap.error(f"--sft-from {args.sft_from}: not a model directory (no config.json)")
    tmp = Path(tempfile.mkdtemp(prefix="miles-bench-agentic-"))
    try:
        t = time.perf_counter()
        model = str(args.sft_from.resolve()) if args.sft_from else warm_start(tmp, args)
        print(f"SFT warm start: {time.perf_counter() - t:.0f} s", flush=True)
        runs = {mode: run(mode, model, tmp, args) for mode in ("sync", "fully_async")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(runs, args)


def report(runs: dict[str, dict], args) -> None:
    base = runs["sync"]["steps_per_s"]
    limit = runs["sync"]["limit"]
    changed = f" with {', '.join(args.set)}" if args.set else ""
    print(f"examples/agentic_async_cpu.yaml{changed}, {args.steps} steps ({args.warmup} warm-up)")
    header = (
        f"{'variant':12}{'steps/s':>9}{'× sync':>8}{'median s':>10}{'lag':>6}{'lag max':>9}"
        f"{'active/limit':>14}{'requests':>10}{'prefix hit':>12}{'of session':>12}{'turns':>7}"
        f"{'CPU busy':>10}{'success ma9':>13}{'episode s (model, sandbox)':>28}"
    )
    print(header)
    for name, r in runs.items():
        print(
            f"{name:12}{r['steps_per_s']:>9.3f}{r['steps_per_s'] / base:>8.2f}"
            f"{r['median_step_s']:>10.2f}{r['lag_mean']:>6.2f}{r['lag_max']:>9.0f}"
            f"{r['active_episodes']:>7.1f}/{limit:<6}{r['active_requests']:>10.1f}"
            f"{r['prefix_cache_hit_rate']:>12.3f}{r['session_prefix_rate']:>12.3f}"
            f"{r['turns_mean']:>7.2f}{r['cpu_busy']:>10.2f}{r['success_ma9_last']:>13.3f}"
            f"{r['episode_s']:>12.2f} ({r['model_s']:.2f}, {r['sandbox_s']:.2f})"
        )
    fa = runs["fully_async"]
    # on the CPU alone, what sync leaves idle bounds what overlap can gain; beside a GPU it
    # bounds nothing (the GPU is the other resource)
    ceiling = (
        1.0 / runs["sync"]["cpu_busy"]
        if runs["sync"]["cpu_busy"] and not torch.cuda.is_available()
        else None
    )
    print(
        f"sync keeps the CPU {runs['sync']['cpu_busy']:.0%} busy: overlap can gain at most "
        f"{ceiling:.2f}× at the same work per step"
        if ceiling
        else ""
    )
    result = {
        "fully_async_over_sync": round(fa["steps_per_s"] / base, 3),
        "cpu_ceiling_over_sync": None if ceiling is None else round(ceiling, 3),
        "mean_lag": round(fa["lag_mean"], 3),
        "max_lag": fa["lag_max"],
        "active_fraction": round(fa["active_fraction"], 3),
        "prefix_cache_hit_rate": round(fa["prefix_cache_hit_rate"], 3),
        "by_variant": {
            k: {f: (round(v, 4) if isinstance(v, float) else v) for f, v in r.items()}
            for k, r in runs.items()
        },
        "targets": {"fully_async_over_sync": 1.5, "active_fraction": 0.8, "prefix_hit": 0.9},
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    if torch.cuda.is_available():  # engines and trainer on CUDA (device auto): its own file
        record_result("agentic_async_gpu", result)
    else:
        record_result("agentic_async", result)


if __name__ == "__main__":
    main()
