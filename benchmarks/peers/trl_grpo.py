"""TRL's side of benchmarks/vs_trl.py: one `GRPOTrainer` run, per-step timings and rewards as JSON.

Runs inside the benchmark-only environment `make bench-trl` builds (`.venv-trl`: torch, the
transformers of our venv, trl 1.16, accelerate, datasets); TRL is a peer, never a dependency of
the package, so only this script imports it. The prompts and the reward are miles_core's own
(`say_a`: `Task.generate` for the prompts, `Task.score` called as a TRL reward function), imported
from the checkout: miles_core's task module needs nothing beyond what this environment has.

One TRL step = one `generate` of prompts × samples completions + rewards + group advantages + one
forward/backward + one AdamW step (beta 0: no reference model; num_iterations 1 and one optimizer
step per generation batch: no old-log-prob forward). Timings:
  - step_s: wall time between consecutive `on_step_end` callbacks (the whole loop iteration:
    data loading, generation, scoring, optimisation, TRL's own logging), so step k ≥ 2 only;
  - generate_s: `_generate_single_turn` (HF `generate` of the batch, unwrapping included);
  - score_s: the rest of `_generate_and_score_completions` (decode, reward, advantages);
  - the remainder (step_s − generate_s − score_s) is forward/backward/optimizer + Trainer work.

    .venv-trl/bin/python benchmarks/peers/trl_grpo.py --model DIR --steps 40 --out trl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF model directory (model + tokenizer)")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True, help="JSON file for the per-step records")
    ap.add_argument("--task", default="say_a")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    t_start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO))
    from miles_core.data.tasks import TASKS  # our prompts and reward, the same code as ours
    from miles_core.run.timeline import mark  # phase marks for benchmarks/time_to_result.py

    mark("main")  # imports done

    task = TASKS.get(args.task)
    examples = task.generate(args.num_prompts, args.data_seed)
    # chat prompts: TRL renders them with the model directory's chat template, as our rollout does
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": e.prompt}] for e in examples]}
    )

    def reward(completions, **_kwargs) -> list[float]:
        return [task.score(c[0]["content"], None).reward for c in completions]

    reward.__name__ = args.task

    timers = {"generate": 0.0, "score": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                timers["generate"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **kw):
            t0 = time.perf_counter()
            g0 = timers["generate"]
            try:
                return super()._generate_and_score_completions(*a, **kw)
            finally:
                timers["score"] += time.perf_counter() - t0 - (timers["generate"] - g0)

    steps: list[dict[str, float]] = []

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.last_end: float | None = None
            self.begin = 0.0

        def on_step_begin(self, _args, state, control, **kw):
            self.begin = time.perf_counter()
            timers["generate"] = timers["score"] = 0.0

        def on_step_end(self, _args, state, control, **kw):
            now = time.perf_counter()
            steps.append(
                {
                    "step": state.global_step,
                    "step_s": (now - self.last_end) if self.last_end is not None else None,
                    "inner_s": now - self.begin,
                    "generate_s": timers["generate"],
                    "score_s": timers["score"],
                }
            )
            self.last_end = now

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1]["reward"] = float(logs["reward"])
                if "completions/mean_length" in logs:
                    steps[-1]["mean_length"] = float(logs["completions/mean_length"])

    batch = args.prompts_per_step * args.samples
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_vllm=False,
            per_device_train_batch_size=batch,  # the whole generation batch in one optimizer step
            gradient_accumulation_steps=1,
            steps_per_generation=1,  # generation_batch_size = batch: one generate per step
            num_generations=args.samples,
            num_iterations=1,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",  # token-level mean over the batch, as train.loss_options.loss_agg token_mean
            scale_rewards="group",
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            max_steps=args.steps,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=args.seed,
            data_seed=args.seed,
        )
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimes()],
        )
        t_train = time.perf_counter()
        mark("steps_start")
        trainer.train()
        mark("steps_end")
        t_end = time.perf_counter()

    record = {
        "steps": steps,
        "startup_s": t_train - t_start,
        "train_wall_s": t_end - t_train,
        "torch_threads": torch.get_num_threads(),
        "versions": {
            m: __import__(m).__version__ for m in ("torch", "transformers", "trl", "accelerate")
        },
        "pid": os.getpid(),
    }
    Path(args.out).write_text(json.dumps(record))
    mark("summary")


if __name__ == "__main__":
    main()
