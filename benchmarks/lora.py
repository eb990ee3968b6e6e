"""LoRA against full fine-tuning, side by side in one run.

1. Trainer memory (small and medium presets): one RL train step in a fresh process, with and
   without `train.lora` (rank 8, every linear layer): parameters that train, the bytes of their
   gradients and AdamW state (tensor sizes); the RSS the trainer added, the same once glibc
   has handed back its free heap (what the trainer holds), and the process's peak, each the
   median of `--rss-runs` (3) fresh processes per preset and mode, taken in rounds: the RSS
   after a step is bimodal, the step's freed activations kept by the C heap or not (medium
   with LoRA: ≈400 or ≈620 MB; held: 150 MB either way).
2. Learning: `examples/say_a_lora.yaml` (rank 8 on the small preset) and the same config without
   `train.lora` at its full fine-tuning learning rate, same seeds: the reward per step and the
   first step whose mean reward reaches 0.8.
3. Multi-LoRA: `examples/multi_lora.yaml` (an SFT warm start on reverse, then two adapters, say_a
   and reverse): each adapter's mean reward over its first and last 5 steps, and the run's wall
   time, at each of `--seeds` (or of `--multi-seeds`).

Prints the tables of the parts it runs, then one JSON object. `--parts` runs some of them
(`memory,learning,multi`); only a run of all three is recorded in benchmarks/results/lora.json
(a partial run writes where `MILES_BENCH_RESULTS_DIR` points, or nowhere).

    python benchmarks/lora.py [--seeds 0,1] [--presets small,medium] [--parts multi]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "say_a_lora.yaml"
MULTI = HERE.parent / "examples" / "multi_lora.yaml"
TARGET = 0.8
FULL_LR = 3e-3  # examples/say_a.yaml's
PARTS = ("memory", "learning", "multi")
RSS = ("trainer_rss_mb", "trainer_held_mb", "peak_rss_mb")  # they vary between processes


def malloc_trim() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim); False elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def peak_rss_mb() -> float:
    """This process's RSS high-water mark (VmHWM), in MiB. Not getrusage's ru_maxrss: Linux
    carries that across exec, so a child spawned (vfork + exec) by a parent holding 1.2 GB read
    1.2 GB whatever it held itself."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_memory(preset: str, lora: bool) -> dict:
    """In this (fresh) process: one RL train step of `preset`; what it holds for training.
    Both modes import peft first (150 MB of modules a LoRA run loads), so the RSS columns
    compare the training state alone."""
    import peft  # noqa: F401
    import psutil
    import torch

    from miles_core.config import load_config
    from miles_core.models import build_model, save_hf_dir
    from miles_core.run.training import build_trainer
    from miles_core.train.batch import TrainBatch
    from miles_core.types import Sample

    sets = [f"model.preset={preset}", "train.global_batch_size=16", "train.micro_batch_size=16"]
    sets += ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4"]
    sets += ["train.lora.rank=8"] if lora else []
    cfg = load_config(None, sets)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_model(preset, seed=0)
        save_hf_dir(model, tok, tmp)
        del model
        before = psutil.Process().memory_info().rss
        trainer = build_trainer(cfg, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        samples = []
        for i in range(16):
            ids = torch.randint(0, tok.vocab_size, (40,), generator=gen).tolist()
            samples.append(
                Sample(
                    group_index=i // 4,
                    index=i,
                    rollout_id=f"r{i}",
                    prompt="x",
                    tokens=ids,
                    response_length=32,
                    loss_mask=[1] * 32,
                    rollout_log_probs=[0.0] * 32,
                    reward=float(i % 2),
                )  # fmt: skip
            )
        batch = TrainBatch.from_samples(samples, [float(i % 2) - 0.5 for i in range(16)], 1.0)
        batch.old_is_current = True
        trainer.train_step(batch)
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        state = trainer.optimizer.state
        out = {
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "trained_params": sum(p.numel() for p in trained),
            "grad_bytes": sum(p.numel() * p.element_size() for p in trained),
            "optimizer_bytes": sum(
                t.numel() * t.element_size()
                for s in state.values()
                for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0
            ),
            "peak_rss_mb": peak_rss_mb(),
            # what building the trainer and its step added (the model, its gradients and
            # optimizer state, activations): RSS after the step over RSS before the build
            "trainer_rss_mb": (psutil.Process().memory_info().rss - before) / 2**20,
        }
        # the same once the C heap has handed back what is free: glibc keeps some of the step's
        # freed activations or not, process by process (medium, LoRA: 400 or 620 MB above, 150
        # here either way), so this is what the trainer holds
        gc.collect()
        if malloc_trim():
            out["trainer_held_mb"] = (psutil.Process().memory_info().rss - before) / 2**20
        trainer.close()
    return out


def memory_once(preset: str, lora: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", preset, "--lora" if lora else "--full"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(presets: list[str], runs: int) -> dict[str, dict[str, dict]]:
    """`child_memory` of each (preset, mode) in `runs` fresh processes, taken in rounds (every
    preset and mode once, then again), so a disturbance of the machine hits each pair alike.
    The RSS columns are the medians (each reading beside them, `<column>_runs`); the tensor
    sizes are the same in every process."""
    pairs = [(p, k) for p in presets for k in ("full", "lora")]
    reads: dict[tuple[str, str], list[dict]] = {pair: [] for pair in pairs}
    for _ in range(runs):
        for p, k in pairs:
            reads[(p, k)].append(memory_once(p, k == "lora"))
    out: dict[str, dict[str, dict]] = {}
    for (p, k), each in reads.items():
        sizes = {key: v for key, v in each[0].items() if key not in RSS}
        assert all({key: v for key, v in m.items() if key not in RSS} == sizes for m in each)
        row = dict(sizes)
        for key in (k for k in RSS if k in each[0]):
            row[key] = statistics.median(m[key] for m in each)
            row[f"{key}_runs"] = [round(m[key], 1) for m in each]
        out.setdefault(p, {})[k] = row
    return out


def learning(seed: int, lora: bool) -> list[float]:
    """Mean reward per step of the example (or its full fine-tuning twin), in process."""
    from miles_core.config import load_config
    from miles_core.run import runtime

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"seed={seed}", f"checkpoint.root={tmp}/ckpt"]
        if not lora:
            sets += ["train.lora=null", f"train.lr={FULL_LR}"]
        cfg = load_config(str(EXAMPLE), sets)
        rt = runtime.RLRuntime(cfg, runtime.prepare_model_dir(cfg, Path(tmp) / "init"), None)
        rewards = []
        try:
            for step in range(cfg.train.num_steps):
                result = rt.rollout(step)
                rt.train(result)
                rt.update_weights()
                rewards.append(sum(s.reward for s in result.samples) / len(result.samples))
        finally:
            rt.close()
    return rewards


def multi_lora(seed: int) -> tuple[dict[str, list[float]], float]:
    """`examples/multi_lora.yaml`: its SFT warm start, then the two adapters' RL; each
    adapter's mean reward per step, and the seconds the whole run took."""
    from miles_core.config import load_config
    from miles_core.run import runtime
    from miles_core.train.sft import run_sft

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(MULTI), [f"seed={seed}", f"checkpoint.root={tmp}/ckpt"])
        start = run_sft(cfg, runtime.prepare_model_dir(cfg, Path(tmp) / "init"), None)
        cfg = cfg.with_model_path(start)
        rt = runtime.RLRuntime(cfg, runtime.prepare_model_dir(cfg, Path(tmp) / "rl"), None)
        curves: dict[str, list[float]] = {name: [] for name in cfg.train.lora.adapters}
        try:
            for step in range(cfg.train.num_steps):
                result = rt.rollout(step)
                rt.train(result)
                rt.update_weights()
                for name, curve in curves.items():
                    curve.append(result.metrics[f"rollout/reward_mean/{name}"])
        finally:
            rt.close()
    return curves, time.perf_counter() - started


def first_reaching(rewards: list[float], target: float) -> int | None:
    return next((i for i, r in enumerate(rewards) if r >= target), None)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--parts", default=",".join(PARTS), help="some of " + ",".join(PARTS))
    ap.add_argument("--rss-runs", type=int, default=3, help="fresh processes per preset, mode")
    ap.add_argument("--multi-seeds", default=None, help="multi-LoRA seeds (default: --seeds)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_memory(args.child, args.lora)))
        return
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    result: dict = {}
    if "memory" in parts:
        mem = memory(args.presets.split(","), args.rss_runs)
        print(
            f"{'preset':8}{'mode':6}{'trained params':>16}{'grad MB':>10}{'AdamW MB':>10}"
            f"{'trainer RSS MB':>16}{'held MB':>9}{'peak RSS MB':>13}"
            f"  (medians of {args.rss_runs}; each process's trainer RSS, held)"
        )
        for p, modes in mem.items():
            for k, m in modes.items():
                print(
                    f"{p:8}{k:6}{m['trained_params']:>16,}{m['grad_bytes'] / 1e6:>10.2f}"
                    f"{m['optimizer_bytes'] / 1e6:>10.2f}{m['trainer_rss_mb']:>16.0f}"
                    f"{m.get('trainer_held_mb', float('nan')):>9.0f}{m['peak_rss_mb']:>13.0f}"
                    f"  {m['trainer_rss_mb_runs']} {m.get('trainer_held_mb_runs')}"
                )
        result["memory"] = mem
        result["rss_runs"] = args.rss_runs
    if "multi" in parts:
        multi_seeds = [int(s) for s in args.multi_seeds.split(",")] if args.multi_seeds else seeds
        print(f"{'adapter':10}{'seed':>6}{'first 5 steps':>15}{'last 5 steps':>14}{'run s':>8}")
        runs = {}
        for seed in multi_seeds:
            curves, wall = multi_lora(seed)
            runs[str(seed)] = {
                "rewards": {name: [round(r, 4) for r in c] for name, c in curves.items()},
                "wall_s": round(wall, 1),
            }
            for name, c in curves.items():
                print(f"{name:10}{seed:>6}{_mean(c[:5]):>15.3f}{_mean(c[-5:]):>14.3f}{wall:>8.0f}")
        result["multi_lora"] = {"example": "examples/multi_lora.yaml", "seeds": runs}
    if "learning" in parts:
        curves = {k: {s: learning(s, k == "lora") for s in seeds} for k in ("full", "lora")}
        print(f"{'mode':6}{'seed':>6}{'steps to ' + str(TARGET):>14}{'last reward':>13}")
        for k, per_seed in curves.items():
            for s, rewards in per_seed.items():
                print(f"{k:6}{s:>6}{str(first_reaching(rewards, TARGET)):>14}{rewards[-1]:>13.3f}")
        result["rewards"] = {
            k: {str(s): [round(r, 4) for r in v] for s, v in c.items()} for k, c in curves.items()
        }
        result["steps_to_target"] = {
            k: {str(s): first_reaching(v, TARGET) for s, v in c.items()} for k, c in curves.items()
        }
        result["target_reward"] = TARGET
        result["example"] = "examples/say_a_lora.yaml"
    print(json.dumps(result))
    if set(parts) != set(PARTS) and not os.environ.get("MILES_BENCH_RESULTS_DIR"):
        print("a partial run (--parts): not recorded", file=sys.stderr)
        return
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("lora", result)


if __name__ == "__main__":
    main()
