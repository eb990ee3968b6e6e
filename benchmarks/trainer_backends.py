"""Train-step time of the Megatron backend against FSDP2 on the same model, batch and ranks.

For each preset (small, medium: random init, built locally) one launch per world size runs the
backends side by side, each on the same fixed batch (32 rows, 64 prompt + 64 response tokens):
one rank (FSDP2 vs Megatron tp=1), two ranks (FSDP2 on two data-parallel ranks vs Megatron
tp=2, pp=2 and dp=2). Each trainer takes 1 warm-up step, then `--steps` timed optimizer steps
(policy loss, one step per batch); the median is reported. On this 2-core CPU machine the
figure is overhead, not speed-up: model parallelism splits work that two cores already share,
and adds gathers, pipeline sends and Megatron's module structure. Prints a table, then one JSON
object as the last line (`megatron_over_fsdp` per preset and layout: > 1 is slower).

    python benchmarks/trainer_backends.py [--steps 5] [--presets small,medium]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROWS, PROMPT, RESPONSE = 32, 64, 64
LAYOUTS = {  # ranks: [(label, backend, train.parallel)]
    1: [("fsdp", "fsdp", {}), ("tp1", "megatron", {})],
    2: [
        ("fsdp", "fsdp", {}),
        ("tp2", "megatron", {"tp": 2}),
        ("pp2", "megatron", {"pp": 2}),
        ("dp2", "megatron", {}),
    ],
}


def worker(model_dir: str, steps: int, out: str) -> None:
    """Under torchrun (or alone): rank 0 times every layout of this world size in turn."""
    import miles_core  # noqa: F401
    from miles_core.config import ParallelConfig, RunConfig
    from miles_core.train import distributed
    from miles_core.train.backend import BACKENDS
    from miles_core.train.batch import TrainBatch

    rank, world = distributed.init_distributed()
    if rank > 0:
        distributed.follow()
        return
    rng = random.Random(0)
    batch = TrainBatch(
        tokens=[[rng.randrange(1, 100) for _ in range(PROMPT + RESPONSE)] for _ in range(ROWS)],
        response_lengths=[RESPONSE] * ROWS,
        loss_masks=[[1] * RESPONSE] * ROWS,
        advantages=[rng.gauss(0, 1) for _ in range(ROWS)],
        rollout_log_probs=[[-2.0] * RESPONSE] * ROWS,
        sample_ids=[str(i) for i in range(ROWS)],
    )
    batch.old_is_current = True
    times = {}
    for label, backend, parallel in LAYOUTS[world]:
        cfg = RunConfig().train.model_copy(
            update={
                "micro_batch_size": 8,
                "world_size": world,
                "parallel": ParallelConfig(**parallel),
                "share_prompts": False,  # the same padded rows through both backends
            }
        )
        trainer = BACKENDS.get(backend)(
            model_dir=model_dir, optim=cfg.model_dump(), loss=cfg.model_dump()
        )
        trainer.train_step(batch)  # warm-up
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            step_s.append(time.perf_counter() - t0)
        trainer.close()
        times[label] = statistics.median(step_s)
    distributed.shutdown()
    Path(out).write_text(json.dumps(times))


def launch(world: int, model_dir: Path, steps: int, out: Path) -> dict[str, float]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launcher = (
        [torchrun, "--standalone", f"--nproc_per_node={world}"] if world > 1 else [sys.executable]
    )
    threads = str(max(1, (os.cpu_count() or 2) // world))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    cmd = [*launcher, str(HERE), "--worker", str(model_dir), str(steps), str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "STEPS", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return
    from miles_core.models import build_model, save_hf_dir

    step_s: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model, tok = build_model(preset, seed=0, context=PROMPT + RESPONSE)
            model_dir = save_hf_dir(model, tok, Path(tmp) / preset)
            step_s[preset] = {
                f"{world}_rank": launch(world, model_dir, args.steps, Path(tmp) / "out.json")
                for world in sorted(LAYOUTS)
            }
    print(f"{'preset':8}{'ranks':>7}{'layout':>8}{'step s':>10}{'vs fsdp':>9}")
    ratios: dict[str, dict[str, float]] = {}
    for preset, per_world in step_s.items():
        for ranks, times in per_world.items():
            for label, t in times.items():
                ratio = t / times["fsdp"]
                print(f"{preset:8}{ranks:>7}{label:>8}{t:>10.3f}{ratio:>9.2f}")
                if label != "fsdp":
                    ratios.setdefault(preset, {})[label] = round(ratio, 3)
    result = {
        "megatron_over_fsdp": ratios,
        "step_time_s": {
            p: {r: {k: round(v, 4) for k, v in t.items()} for r, t in w.items()}
            for p, w in step_s.items()
        },
        "batch": {"rows": ROWS, "prompt_tokens": PROMPT, "response_tokens": RESPONSE},
        "steps_timed": args.steps,
    }
    print(json.dumps(result))
    sys.path.insert(0, str(HERE.parent))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("trainer_backends", result)


if __name__ == "__main__":
    main()
