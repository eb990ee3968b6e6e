"""Supervised fine-tuning data: chat-rendered prompt + reference answer, loss only on the answer.

The loss itself is the registered `sft` loss (masked cross-entropy, `train/losses/sft.py`), run
by the trainer backend `train.backend` chooses: `trainer.train_step(batch, loss="sft")`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from miles_core.data.dataset import DatasetError
from miles_core.data.tasks import Example
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.train.batch import TrainBatch


def sft_sample(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(prompt + answer + eos ids, loss mask over the answer incl. eos)."""
    if example.answer is None:
        raise DatasetError(f"SFT example {example.prompt!r} has no 'answer'")
    prompt = encode_prompt(tokenizer, example.prompt)
    answer = tokenizer.encode(example.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, [1] * len(answer)


def sft_batches(
    tokenizer,
    examples: list[Example],
    batch_size: int,
    seed: int,
    task=None,
    family: str = "tiny",
) -> Iterator[TrainBatch]:
    """Endless shuffled batches (a new order every epoch). A task with
    `demonstration(example, family)` (multi-turn: loss only on the assistant's turns) supplies
    its own samples, rendered with the run's TITO family `family` (`agent.family`)."""
    demo = getattr(task, "demonstration", None)
    if demo is not None:  # demonstrations run commands in sandboxes: a few at a time
        from concurrent.futures import ThreadPoolExecutor

        from miles_core.tito import build_family

        chat = build_family(family)
        with ThreadPoolExecutor(max_workers=4) as pool:
            encoded = list(pool.map(lambda ex: demo(ex, chat), examples))
    else:
        encoded = [sft_sample(tokenizer, ex) for ex in examples]
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            more = list(range(len(encoded)))
            rng.shuffle(more)
            order.extend(more)
        take, order = order[:batch_size], order[batch_size:]
        rows = [encoded[i] for i in take]
        yield TrainBatch(
            tokens=[t for t, _ in rows],
            response_lengths=[len(m) for _, m in rows],
            loss_masks=[m for _, m in rows],
        )


def run_sft(config, model_dir, tracker) -> str:
    """Trains `config.sft.num_steps` steps from `model_dir`; saves and returns the policy's URI.
    `tracker`: the MLflow run to log to (None: nothing logged, as for `RLRuntime`)."""
    import time
    from pathlib import Path

    from miles_core.checkpoint.store import CheckpointStore
    from miles_core.data import sft_examples
    from miles_core.models import load_hf_dir
    from miles_core.run.progress import reporter
    from miles_core.train.backend import BACKENDS

    sft = config.sft
    _, tokenizer = load_hf_dir(model_dir)
    examples = sft_examples(sft)
    trainer = BACKENDS.get(config.train.backend)(
        model_dir=str(model_dir),
        optim=sft.model_dump(),
        loss=None,
        total_steps=sft.num_steps,
        seed=config.seed,
        device=config.train.device,
    )
    from miles_core.data import TASKS

    task = TASKS.get(sft.task)
    batches = sft_batches(
        tokenizer, examples, sft.batch_size, sft.seed, task, config.agent.family
    )  # demonstrations: rendered with the run's family
    report = reporter()
    report.start(sft.num_steps, "sft")
    try:
        for step in range(sft.num_steps):
            t0 = time.perf_counter()
            metrics = trainer.train_step(next(batches), loss="sft")
            step_time = time.perf_counter() - t0
            if tracker is not None:
                tracker.log_metrics(
                    {f"sft/{k}": v for k, v in metrics.items()}
                    | {"perf/sft_step_time_s": step_time},
                    step,
                )
                if step % 20 == 0 or step + 1 == sft.num_steps:
                    tracker.flush()
            report.update(step, {"loss": metrics["loss"], "step_s": step_time})
        store = CheckpointStore(
            config.checkpoint.root, f"{config.name}-sft", config.checkpoint.storage_options
        )

        def write(directory: Path) -> None:
            trainer.save(str(directory))
            tokenizer.save_pretrained(str(directory))

        uri = store.save(
            sft.num_steps,
            write,
            {
                "step": sft.num_steps,
                "kind": "sft",
                "mlflow_run_id": tracker.run_id if tracker else None,
            },
        )
        store.close()
    except BaseException:
        if tracker is not None:
            tracker.finish("FAILED")
        raise
    finally:
        trainer.close()
        report.stop()
    if tracker is not None:
        tracker.finish()
    return uri
