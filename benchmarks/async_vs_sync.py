"""Steps/s and reward per sample of sync, one-step-off and fully async RL, side by side, each
run by the loops a flow runs (`miles_core/run/loops.py`: the trainer on this thread, the producer
and, in fully async, the weight push on threads of their own), without Prefect.

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

`fully_async` pushes each policy from a snapshot while the next step trains
(`rollout.mode_options.overlap_push`, the default); `fully_async_inline` is the same run with the
trainer waiting for each push, as before the overlap: `overlap_push_gain` is the one over the
other.

`--repeat N` runs the whole comparison N times in a row; the JSON's `runs` holds each one's
ratios, the other fields the last one's. `--variants a,b` runs only those.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from miles_core.config import load_config
from miles_core.run.loops import Phases, RunLoops
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


VARIANTS = {  # name: (rollout.mode, threads of the trainer and of the engine, extra settings)
    "sync_1t": ("sync", 1, []),
    "sync_2t": ("sync", 2, []),
    "one_step_off": ("one_step_off", 1, []),
    "fully_async_inline": ("fully_async", 1, ["rollout.mode_options.overlap_push=false"]),
    "fully_async": ("fully_async", 1, []),
}


class StepRecord:
    """What RunLoops logs of each step (a StepLog's part of it): its merged metrics."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def step(self, step: int, t0: float, *parts: dict[str, float], t_end: float = 0.0) -> None:
        self.steps[step] = {k: v for p in parts for k, v in p.items()}

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        pass


def run(name: str, steps: int, warmup: int, args) -> dict:
    mode, threads, extra = VARIANTS[name]
    tmp = Path(tempfile.mkdtemp(prefix="miles-bench-"))
    staleness = [f"rollout.mode_options.max_staleness={args.max_staleness}"]
    cfg = load_config(
        None,
        [
            f"name=bench-{name}",
            f"model.preset={args.preset}",
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
            *(staleness if mode == "fully_async" else []),
            *extra,
            f"rollout.pause_mode={args.pause_mode}",
            f"train.num_steps={steps}",
            f"checkpoint.root={tmp}/ckpt",
        ],
    )
    rt = RLRuntime(cfg, prepare_model_dir(cfg, tmp), None)
    if mode != "sync":
        pin_one_core_each(rt)
    phases = dict.fromkeys(PHASES, 0.0)  # seconds per phase over the timed steps
    mark: dict[str, float] = {}

    def clocked(phase: str, fn):
        def call(*a):
            t = time.perf_counter()
            out = fn(*a)
            phases[phase] += time.perf_counter() - t
            return out

        return call

    def rollout(rt: RLRuntime, step: int):
        if step == warmup:  # the timed steps start here
            mark["t0"] = time.perf_counter()
            phases.update(dict.fromkeys(PHASES, 0.0))
            mark.update({f"cpu0_{k}": v for k, v in cpu_seconds(rt).items()})
        return rt.rollout(step)

    record = StepRecord()
    loops = RunLoops(
        rt,
        record,  # type: ignore[arg-type]
        Phases(
            rollout=clocked("rollout", rollout),
            train=clocked("train", lambda rt, result: rt.train(result)),
            push=clocked("update_weights", lambda rt, snapshot=None: rt.update_weights(snapshot)),
            save=lambda rt, step, metrics=None: {},
            evaluate=lambda rt, version: None,
            collect=lambda rt, wait=False: [],
        ),
    )
    try:
        beside = [
            threading.Thread(target=loops.run, args=(n,), daemon=True)
            for n in loops.loops
            if n != "train"
        ]
        for t in beside:
            t.start()
        loops.run("train")
        seconds = time.perf_counter() - mark["t0"]
        cpu1 = cpu_seconds(rt)
        for t in beside:
            t.join()
    finally:
        rt.close()
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        shutil.rmtree(tmp, ignore_errors=True)
    cpu0 = {k.removeprefix("cpu0_"): v for k, v in mark.items() if k.startswith("cpu0_")}
    timed = steps - warmup
    rows = [record.steps[i] for i in range(steps)]
    rewards = [m["rollout/reward_mean"] for m in rows]
    return {
        "steps_per_s": timed / seconds,
        "rewards": rewards,
        "reward_last5": statistics.fmean(rewards[-5:]),
        "mean_staleness": statistics.fmean(
            m.get("rollout/staleness/mean", 0.0) for m in rows[warmup:]
        ),
        "threads": threads,
        "loops": loops.loops,
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
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in order")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    by_run = []
    for i in range(args.repeat):
        runs = compare(args)
        by_run.append(ratios(runs))
        print(f"run {i + 1}/{args.repeat}: {json.dumps(by_run[-1])}", flush=True)
    report(runs, by_run, args)


def ratios(runs: dict[str, dict]) -> dict[str, float]:
    """One comparison's ratios: each variant over the faster sync one (if run), and the
    overlapped push over the inline one (if both ran)."""
    out: dict[str, float] = {}
    syncs = [k for k in ("sync_1t", "sync_2t") if k in runs]
    if syncs:
        base = max(runs[k]["steps_per_s"] for k in syncs)
        out["sync_steps_per_s"] = round(base, 3)
        for k in ("one_step_off", "fully_async_inline", "fully_async"):
            if k in runs:
                out[f"{k}_over_sync"] = round(runs[k]["steps_per_s"] / base, 3)
    if "fully_async" in runs and "fully_async_inline" in runs:
        gain = runs["fully_async"]["steps_per_s"] / runs["fully_async_inline"]["steps_per_s"]
        out["overlap_push_gain"] = round(gain, 3)
    return out


def compare(args) -> dict[str, dict]:
    """One comparison: every variant asked for, one after another."""
    return {name: run(name, args.steps, args.warmup, args) for name in args.variants}


def report(runs: dict[str, dict], by_run: list[dict], args) -> None:
    """The last comparison in full, and every comparison's ratios (`runs`)."""
    syncs = [k for k in ("sync_1t", "sync_2t") if k in runs]
    sync_name = max(syncs, key=lambda k: runs[k]["steps_per_s"]) if syncs else next(iter(runs))
    base = runs[sync_name]["steps_per_s"]
    print(f"preset {args.preset}, task {args.task}, {args.prompts}×{args.samples} samples/step")
    print(
        f"{'variant':20}{'threads':>8}{'steps/s':>10}{'× base':>8}{'staleness':>11}"
        f"{'reward last5':>14}  loops"
    )
    for name, r in runs.items():
        print(
            f"{name:20}{r['threads']:>8}{r['steps_per_s']:>10.3f}{r['steps_per_s'] / base:>8.2f}"
            f"{r['mean_staleness']:>11.2f}{r['reward_last5']:>14.3f}  {','.join(r['loops'])}"
        )
    estimate = None
    if "sync_1t" in runs:
        one = runs["sync_1t"]["cpu_s"]
        estimate = overlap_estimate(1 / base, one)
        print(
            f"CPU s per step at one thread each: engine server {one['engine']:.3f}, trainer "
            f"process {one['trainer']:.3f}; overlap of the two on one core each: "
            f"{estimate:.2f}× {sync_name}"
        )
    print(f"{'engine server, per trained step':34}{'CPU s':>8}{'in steps s':>12}{'steps':>8}")
    for name, r in runs.items():
        e = r["engine"]
        print(f"  {name:32}{r['cpu_s']['engine']:>8.3f}{e['busy']:>12.3f}{e['steps']:>8.1f}")
    print("phase seconds per step (async: the trainer's waits, not work):")
    for name, r in runs.items():
        print(f"  {name:20}" + "  ".join(f"{k} {v:.3f}" for k, v in r["phase_s"].items()))
    last = by_run[-1]
    result = {
        **{k: v for k, v in last.items() if k.endswith("_over_sync") or k == "overlap_push_gain"},
        "overlap_estimate_over_sync": None if estimate is None else round(estimate, 3),
        "mean_staleness": round(runs.get("fully_async", runs[sync_name])["mean_staleness"], 3),
        "sync_baseline": sync_name,
        "steps_per_s": {k: round(r["steps_per_s"], 3) for k, r in runs.items()},
        "reward_last5": {k: round(r["reward_last5"], 3) for k, r in runs.items()},
        "mean_staleness_by_variant": {k: round(r["mean_staleness"], 3) for k, r in runs.items()},
        "threads": {k: r["threads"] for k, r in runs.items()},
        "loops": {k: r["loops"] for k, r in runs.items()},
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
