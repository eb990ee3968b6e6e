"""Steps/s and reward per sample of sync, one-step-off and fully async RL, side by side.

Same model, task, data order and seeds for every variant; the engine is a server subprocess and
weights travel by shared memory in all of them. Sync runs at each thread setting (engine and
trainer with 1 or 2 threads each, one phase at a time) and the fastest is the baseline; the
async variants run the trainer and the engine at one thread each, pinned to one core each. The first `--warmup` steps are not timed. Prints a table, then one JSON object.

`overlap_estimate_over_sync` (`overlap_estimate`): what overlap would give if each process did
the work it does in the 1-thread sync run: the sync baseline's step against the larger of the
engine server's and the trainer process's CPU seconds per step there (async pins each to one
core). An estimate, not a bound: the async modes change the engine's work per trained step, which
the per-variant engine counters show (`engine_per_step`: seconds in its steps, steps, requests
per step). Where one side does most of the work, overlapping the two gains little.

    python benchmarks/async_vs_sync.py [--preset tiny] [--steps 24] [--warmup 4] [--repeat 5]

`--repeat N` runs the whole comparison N times in a row; the JSON's `runs` holds each one's
ratios, the other fields the last one's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from miles_core.config import load_config
from miles_core.run.runtime import RLRuntime, prepare_model_dir

PHASES = ("rollout", "train", "update_weights")
ENGINE = ("busy", "steps", "rows")  # the engine server's counters, per trained step


def overlap_estimate(sync_step_s: float, cpu_s: dict[str, float]) -> float:
    """The gain over a sync step of `sync_step_s` when the engine server and the trainer's process
    each get one core and each does the work of the 1-thread sync run (`cpu_s`: "engine" and
    "trainer", CPU seconds per step there): a step then takes the larger of the two."""
    return sync_step_s / max(cpu_s["engine"], cpu_s["trainer"])


def cpu_seconds(rt: RLRuntime) -> dict[str, float]:
    """CPU seconds so far of this (the trainer's) process and of the engine server, and the
    engine's own counters: seconds inside its steps (`busy`), its steps, and the requests those
    steps ran, summed over them (`rows`)."""
    engine = psutil.Process(rt.engine_process.pid).cpu_times()
    info = rt.engine.server_info()
    return {
        "trainer": time.process_time(),
        "engine": engine.user + engine.system,
        "engine_busy": info["busy_seconds"],
        "engine_steps": info["steps"],
        "engine_rows": info["running_sum"],
    }


def run(preset: str, steps: int, warmup: int, mode: str, threads: int, args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="miles-bench-"))
    cfg = load_config(
        None,
        [
            f"name=bench-{mode}",
            f"model.preset={preset}",
            f"data.task={args.task}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.n_samples_per_prompt={args.samples}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.global_batch_size={args.prompts * args.samples}",
            f"train.micro_batch_size={args.prompts * args.samples}",
            f"train.lr={args.lr}",
            f"train.threads={threads}",
            "rollout.engine=server",
            f"rollout.engine_options.threads={threads}",
            "weight_sync.transport=shared_memory",
            f"rollout.mode={mode}",
            f"rollout.max_staleness={args.max_staleness}",
            f"rollout.pause_mode={args.pause_mode}",
            f"checkpoint.root={tmp}/ckpt",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, tmp), None)
    if mode != "sync":
        pin_one_core_each(rt)
    rewards, staleness, t0 = [], [], 0.0
    phases = dict.fromkeys(PHASES, 0.0)  # seconds per phase over the timed steps

    def clocked(phase: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        phases[phase] += time.perf_counter() - t
        return out

    try:
        for step in range(steps):
            if step == warmup:
                t0 = time.perf_counter()
                phases.update(dict.fromkeys(PHASES, 0.0))
                cpu0 = cpu_seconds(rt)
            result = clocked("rollout", rt.rollout, step)
            clocked("train", rt.train, result)
            clocked("update_weights", rt.update_weights)
            rewards.append(result.metrics["rollout/reward_mean"])
            staleness.append(result.metrics.get("rollout/staleness/mean", 0.0))
        seconds = time.perf_counter() - t0
        cpu1 = cpu_seconds(rt)
    finally:
        rt.close()
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        shutil.rmtree(tmp, ignore_errors=True)
    timed = steps - warmup
    return {
        "steps_per_s": timed / seconds,
        "rewards": rewards,
        "reward_last5": statistics.fmean(rewards[-5:]),
        "mean_staleness": statistics.fmean(staleness[warmup:]),
        "threads": threads,
        "phase_s": {k: v / timed for k, v in phases.items()},  # async: waits, not work
        # per trained step: each process's CPU seconds, the engine's seconds in its steps, its
        # steps and the requests they ran (async modes mix steps' groups in one engine step)
        "cpu_s": {k: (cpu1[k] - cpu0[k]) / timed for k in ("trainer", "engine")},
        "engine": {k: (cpu1[f"engine_{k}"] - cpu0[f"engine_{k}"]) / timed for k in ENGINE},
    }


def pin_one_core_each(rt: RLRuntime) -> None:
    """The async variants' trainer (this thread) on core 0, every engine-server thread on core 1."""
    if len(os.sched_getaffinity(0)) < 2 or rt.engine_process is None:
        return
    os.sched_setaffinity(0, {0})
    for tid in os.listdir(f"/proc/{rt.engine_process.pid}/task"):
        os.sched_setaffinity(int(tid), {1})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--task", default="say_a")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--pause-mode", default="retract", choices=["abort", "retract", "in_place"])
    ap.add_argument("--repeat", type=int, default=1, help="whole comparisons, one after another")
    args = ap.parse_args()
    by_run = []
    for i in range(args.repeat):
        runs = compare(args)
        sync_name = max(("sync_1t", "sync_2t"), key=lambda k: runs[k]["steps_per_s"])
        base = runs[sync_name]["steps_per_s"]
        by_run.append(
            {
                "fully_async_over_sync": round(runs["fully_async"]["steps_per_s"] / base, 3),
                "one_step_off_over_sync": round(runs["one_step_off"]["steps_per_s"] / base, 3),
                "sync_steps_per_s": round(base, 3),
            }
        )
        print(f"run {i + 1}/{args.repeat}: {json.dumps(by_run[-1])}", flush=True)
    report(runs, sync_name, base, by_run, args)


def compare(args) -> dict[str, dict]:
    """One comparison: both sync thread settings, then the two async modes."""
    runs = {
        f"sync_{t}t": run(args.preset, args.steps, args.warmup, "sync", t, args) for t in (1, 2)
    }
    runs["one_step_off"] = run(args.preset, args.steps, args.warmup, "one_step_off", 1, args)
    runs["fully_async"] = run(args.preset, args.steps, args.warmup, "fully_async", 1, args)
    return runs


def report(runs: dict[str, dict], sync_name: str, base: float, by_run: list[dict], args) -> None:
    """The last comparison in full, and every comparison's ratios (`runs`)."""
    estimate = overlap_estimate(1 / base, runs["sync_1t"]["cpu_s"])
    print(f"preset {args.preset}, task {args.task}, {args.prompts}×{args.samples} samples/step")
    print(
        f"{'variant':14}{'threads':>8}{'steps/s':>10}{'× sync':>8}{'staleness':>11}{'reward last5':>14}"
    )
    for name, r in runs.items():
        print(
            f"{name:14}{r['threads']:>8}{r['steps_per_s']:>10.3f}{r['steps_per_s'] / base:>8.2f}"
            f"{r['mean_staleness']:>11.2f}{r['reward_last5']:>14.3f}"
        )
    one = runs["sync_1t"]["cpu_s"]
    print(
        f"CPU s per step at one thread each: engine server {one['engine']:.3f}, trainer process "
        f"{one['trainer']:.3f}; overlap of the two on one core each: {estimate:.2f}× {sync_name}"
    )
    print(
        f"{'engine server, per trained step':34}{'CPU s':>8}{'in steps s':>12}{'steps':>8}{'rows/step':>11}"
    )
    for name, r in runs.items():
        e = r["engine"]
        print(
            f"  {name:32}{r['cpu_s']['engine']:>8.3f}{e['busy']:>12.3f}{e['steps']:>8.1f}"
            f"{e['rows'] / max(e['steps'], 1e-9):>11.1f}"
        )
    print("reward per step (samples consumed = step × samples/step):")
    for name, r in runs.items():
        print(f"  {name:14}" + " ".join(f"{x:.2f}" for x in r["rewards"]))
    result = {
        "fully_async_over_sync": round(runs["fully_async"]["steps_per_s"] / base, 3),
        "one_step_off_over_sync": round(runs["one_step_off"]["steps_per_s"] / base, 3),
        "overlap_estimate_over_sync": round(estimate, 3),
        "mean_staleness": round(runs["fully_async"]["mean_staleness"], 3),
        "sync_baseline": sync_name,
        "steps_per_s": {k: round(r["steps_per_s"], 3) for k, r in runs.items()},
        "reward_last5": {k: round(r["reward_last5"], 3) for k, r in runs.items()},
        "mean_staleness_by_variant": {k: round(r["mean_staleness"], 3) for k, r in runs.items()},
        "threads": {k: r["threads"] for k, r in runs.items()},
        "phase_s": {k: {p: round(x, 4) for p, x in r["phase_s"].items()} for k, r in runs.items()},
        "cpu_s": {k: {p: round(x, 4) for p, x in r["cpu_s"].items()} for k, r in runs.items()},
        "engine_per_step": {
            k: {p: round(x, 4) for p, x in r["engine"].items()} for k, r in runs.items()
        },
        "preset": args.preset,
        "target": 1.6,
        "runs": by_run,  # each comparison's ratios; the fields above are the last one's
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("async_vs_sync", result)


if __name__ == "__main__":
    main()
