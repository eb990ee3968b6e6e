"""A run as a user waits for it: `miles train` against TRL's `GRPOTrainer` from process start to
process exit, with each process's phases.

The workload is benchmarks/vs_trl.py's (one HF model directory per preset built by our builder,
say_a, 4 prompts × 8 samples, 32 new tokens, constant lr 1e-3, the same command lines), 40 steps
by default. Per preset, after two runs that find no Prefect server running:

  - `miles_new_home`: a new PREFECT_HOME, so the run creates Prefect's database and starts the
    server (a user's very first run);
  - `miles_server_stopped`: the database there, no server (the first run after the server stopped
    itself, flows/prefect_server.py);

the timed sides run interleaved, `--rounds` times, each a fresh process:

  - `miles`: `miles train` (embedded engine), the Prefect server kept from the run before;
  - `trl`: benchmarks/peers/trl_grpo.py in `.venv-trl` (`make bench-trl` builds it);
  - `miles_servers`: `rollout.engine=server` with 2 engine servers behind sglang-router.

Every process appends its phase marks to a file (miles_core/run/timeline.py, `MILES_TIMELINE`); the
harness adds the process's start (just before it is spawned) and its exit (when it is reaped):

  to main        interpreter start and the command's own module (TRL: all its imports)
  checks         ours: config and input checks (preflight), torch and the trainer's imports
  orchestration  ours: until the Prefect API answers (a server starting meanwhile)
  setup          until the first step: MLflow run, model, engine, trainer (TRL: data, model,
                 trainer)
  steps          the steps
  finish         the last step to the printed result (reward curve, final records)
  exit           the printed result to the process's exit

Prints a table, then one JSON object as the last line: per preset `wall_vs_trl` (median wall
time of `miles` ÷ TRL's), `wall_vs_trl_servers`, `to_first_step_s` and `exit_after_summary_s`
(the largest of the timed `miles` runs).

    make bench-trl   # once: the TRL environment
    .venv/bin/python benchmarks/time_to_result.py --presets tiny,small --rounds 2
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
sys.path.insert(0, str(REPO))

from vs_trl import (  # noqa: E402  (benchmarks/vs_trl.py: the same workload and commands)
    WORKLOAD,
    build_model_dir,
    ours_command,
    run_env,
    trl_command,
)

from flows.prefect_server import stop_local  # noqa: E402
from miles_core.run.timeline import ENV as TIMELINE_ENV  # noqa: E402

PHASES = ("to_main", "checks", "orchestration", "setup", "steps", "finish", "exit")
# each phase ends at a mark; a side that has no such mark (TRL: no checks, no orchestration)
# runs that phase as part of the next
ENDS = {
    "to_main": "main",
    "checks": "preflight",
    "orchestration": "api_ready",
    "setup": "steps_start",
    "steps": "steps_end",
    "finish": "summary",
    "exit": "exit",
}
SERVERS = (
    "rollout.engine=server",
    "rollout.engine_options.num_engines=2",
    "weight_sync.transport=shared_memory",
)


def timed(cmd: list[str], env: dict[str, str], work: Path, name: str) -> dict[str, float]:
    """Runs `cmd` to its exit: seconds from the spawn to each mark, and to the exit."""
    timeline = work / f"{name}.timeline"
    timeline.unlink(missing_ok=True)
    log = work / f"{name}.log"
    t0 = time.time()
    with log.open("w") as out:
        code = subprocess.call(
            cmd, cwd=REPO, env=env | {TIMELINE_ENV: str(timeline)}, stdout=out, stderr=out
        )
    ended = time.time()
    if code:
        raise RuntimeError(f"{name} exited {code}; log {log}:\n{log.read_text()[-3000:]}")
    marks = {}
    for line in timeline.read_text().splitlines():
        event = json.loads(line)
        marks.setdefault(event["event"], event["t"] - t0)  # the command's own marks come first
    marks["exit"] = ended - t0
    return marks


def phases_of(marks: dict[str, float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    last = 0.0
    for phase in PHASES:
        at = marks.get(ENDS[phase])
        out[phase] = None if at is None else round(at - last, 3)
        last = at if at is not None else last
    return out


def summary(runs: list[dict[str, float]], steps: int) -> dict[str, Any]:
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    phases = [phases_of(m) for m in runs]
    return {
        "wall_s": [round(m["exit"], 2) for m in runs],
        "wall_s_median": med([m["exit"] for m in runs]),
        "phases_s": {
            p: med([x[p] for x in phases]) if all(x[p] is not None for x in phases) else None
            for p in PHASES
        },
        "to_first_step_s": med([m["steps_start"] for m in runs]),
        "s_per_step": med([(m["steps_end"] - m["steps_start"]) / steps for m in runs]),
        "exit_after_summary_s": round(max(m["exit"] - m["summary"] for m in runs), 3),
    }


def measure(preset: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    steps = args.steps
    model_dir = build_model_dir(preset, work / f"model-{preset}")
    home = work / f"prefect-{preset}"
    env = run_env(home)
    env.pop("PREFECT_API_URL", None)  # the kept local server, as a user without one has

    def ours(name: str, *extra: str) -> dict[str, float]:
        return timed(
            ours_command(model_dir, "embedded", steps, work, name, *extra), env, work, name
        )

    cold = {"miles_new_home": ours(f"{preset}-new-home")}
    stop_local(home)
    cold["miles_server_stopped"] = ours(f"{preset}-server-stopped")
    runs: dict[str, list[dict[str, float]]] = {"miles": [], "trl": [], "miles_servers": []}
    for rnd in range(args.rounds):
        for side in runs:
            name = f"{preset}-{side}-{rnd}".replace("_", "-")
            if side == "trl":
                out = work / f"{name}.json"
                marks = timed(trl_command(args.trl_python, model_dir, steps, out), env, work, name)
            else:
                marks = ours(name, *(SERVERS if side == "miles_servers" else ()))
            runs[side].append(marks)
            print(
                f"  {preset} round {rnd} {side:14} {marks['exit']:6.1f} s "
                f"(first step at {marks['steps_start']:.1f} s, load {os.getloadavg()[0]:.2f})",
                file=sys.stderr,
                flush=True,
            )
    stop_local(home)
    sides = {side: summary(r, steps) for side, r in runs.items()}
    trl = sides["trl"]["wall_s_median"]
    return {
        "params": int((model_dir / "params.txt").read_text()),
        "steps": steps,
        "rounds": args.rounds,
        "measured_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_vs_trl": round(sides["miles"]["wall_s_median"] / trl, 3),
        "wall_vs_trl_servers": round(sides["miles_servers"]["wall_s_median"] / trl, 3),
        "sides": sides,
        "cold": {k: summary([m], steps) for k, m in cold.items()},
    }


def result_of(presets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "wall_vs_trl": {p: d["wall_vs_trl"] for p, d in presets.items()},
        "wall_vs_trl_servers": {p: d["wall_vs_trl_servers"] for p, d in presets.items()},
        "to_first_step_s": {p: d["sides"]["miles"]["to_first_step_s"] for p, d in presets.items()},
        "exit_after_summary_s": {
            p: d["sides"]["miles"]["exit_after_summary_s"] for p, d in presets.items()
        },
        "targets": {"wall_vs_trl": 1.2, "to_first_step_s": 15, "exit_after_summary_s": 2},
        "workload": WORKLOAD,
        "presets": presets,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'preset':7}{'side':22}{'wall s':>8}{'× TRL':>7}{'1st step':>9}  "
        + " ".join(f"{p:>13}" for p in PHASES)
    )
    for preset, d in result["presets"].items():
        trl = d["sides"]["trl"]["wall_s_median"]
        rows = {**d["sides"], **d["cold"]}
        for side, s in rows.items():
            phases = " ".join(
                f"{'—' if s['phases_s'][p] is None else format(s['phases_s'][p], '.2f'):>13}"
                for p in PHASES
            )
            print(
                f"{preset:7}{side:22}{s['wall_s_median']:>8.1f}{s['wall_s_median'] / trl:>7.2f}"
                f"{s['to_first_step_s']:>9.1f}  {phases}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per preset")
    ap.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    args = ap.parse_args()
    if not args.trl_python.exists():
        sys.exit(f"{args.trl_python} not found: `make bench-trl` builds the TRL environment")

    from record import record_result  # benchmarks/record.py

    presets = {}
    with tempfile.TemporaryDirectory(prefix="time-to-result-") as tmp:
        for preset in args.presets.split(","):
            presets[preset] = measure(preset, args, Path(tmp))
    result = result_of(presets)
    result["command"] = " ".join(["python", "benchmarks/time_to_result.py", *sys.argv[1:]])
    print_table(result)
    print(json.dumps(result))
    record_result("time_to_result", result)


if __name__ == "__main__":
    main()
