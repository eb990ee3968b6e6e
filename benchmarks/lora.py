"""LoRA against full fine-tuning, side by side in one run.

1. Trainer memory (small and medium presets): one RL train step in a fresh process each, with
   and without `train.lora` (rank 8, every linear layer): parameters that train, the bytes of
   their gradients and AdamW state (tensor sizes), and the process's peak RSS.
2. Learning: `examples/say_a_lora.yaml` (rank 8 on the small preset) and the same config without
   `train.lora` at its full fine-tuning learning rate, same seeds: the reward per step and the
   first step whose mean reward reaches 0.8.
3. Multi-LoRA: `examples/multi_lora.yaml` (an SFT warm start on reverse, then two adapters, say_a
   and reverse): each adapter's mean reward over its first and last 5 steps.

Prints three tables, then one JSON object.

    python benchmarks/lora.py [--seeds 0,1] [--presets small,medium]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "say_a_lora.yaml"
MULTI = HERE.parent / "examples" / "multi_lora.yaml"
TARGET = 0.8
FULL_LR = 3e-3  # examples/say_a.yaml's


def child_memory(preset: str, lora: bool) -> dict:
    """In this (fresh) process: one RL train step of `preset`; what it holds for training.
    Both modes import peft first (150 MB of modules a LoRA run loads), so the RSS columns
    compare the training state alone."""
    import resource

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
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            # what building the trainer and its step added (the model, its gradients and
            # optimizer state, activations): RSS after the step over RSS before the build
            "trainer_rss_mb": (psutil.Process().memory_info().rss - before) / 2**20,
        }
        trainer.close()
    return out


def memory(preset: str, lora: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", preset, "--lora" if lora else "--full"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def multi_lora(seed: int) -> dict[str, list[float]]:
    """`examples/multi_lora.yaml`: its SFT warm start, then the two adapters' RL; each
    adapter's mean reward per step."""
    from miles_core.config import load_config
    from miles_core.run import runtime
    from miles_core.train.sft import run_sft

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
    return curves


def first_reaching(rewards: list[float], target: float) -> int | None:
    return next((i for i, r in enumerate(rewards) if r >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--child", default=None)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_memory(args.child, args.lora)))
        return
    mem = {
        p: {k: memory(p, k == "lora") for k in ("full", "lora")} for p in args.presets.split(",")
    }
    print(
        f"{'preset':8}{'mode':6}{'trained params':>16}{'grad MB':>10}{'AdamW MB':>10}"
        f"{'trainer RSS MB':>16}{'peak RSS MB':>13}"
    )
    for p, modes in mem.items():
        for k, m in modes.items():
            print(
                f"{p:8}{k:6}{m['trained_params']:>16,}{m['grad_bytes'] / 1e6:>10.2f}"
                f"{m['optimizer_bytes'] / 1e6:>10.2f}{m['trainer_rss_mb']:>16.0f}"
                f"{m['peak_rss_mb']:>13.0f}"
            )
    seeds = [int(s) for s in args.seeds.split(",")]
    curves = {k: {s: learning(s, k == "lora") for s in seeds} for k in ("full", "lora")}
    print(f"{'mode':6}{'seed':>6}{'steps to ' + str(TARGET):>14}{'last reward':>13}")
    for k, per_seed in curves.items():
        for s, rewards in per_seed.items():
            print(f"{k:6}{s:>6}{str(first_reaching(rewards, TARGET)):>14}{rewards[-1]:>13.3f}")
    multi = multi_lora(seeds[0])
    print(f"{'adapter':10}{'first 5 steps':>15}{'last 5 steps':>14}")
    for name, curve in multi.items():
        print(f"{name:10}{sum(curve[:5]) / 5:>15.3f}{sum(curve[-5:]) / 5:>14.3f}")
    result = {
        "multi_lora": {
            "example": "examples/multi_lora.yaml",
            "seed": seeds[0],
            "rewards": {name: [round(r, 4) for r in c] for name, c in multi.items()},
        },
        "memory": mem,
        "rewards": {
            k: {str(s): [round(r, 4) for r in v] for s, v in c.items()} for k, c in curves.items()
        },
        "steps_to_target": {
            k: {str(s): first_reaching(v, TARGET) for s, v in c.items()} for k, c in curves.items()
        },
        "target_reward": TARGET,
        "example": "examples/say_a_lora.yaml",
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("lora", result)


if __name__ == "__main__":
    main()
