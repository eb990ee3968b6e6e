"""What `train.true_on_policy` costs: engine decode throughput and train step time with and without
the mode, per preset, side by side in one run.

Per preset (random init, seeded): the serving engine generates `--rows` samples of the `reverse`
prompts, up to `--new` new tokens each, plain and invariant, alternating, `--repeat` times after
a warm-up (generated tokens per second of the wall time of one batch, median). The plain
engine's batch is then one training batch for two FSDP2 trainers of the same weights, the
default one (shared prompts) and the mode's: one warm-up step each, then `--steps` optimizer
steps taken alternately (median). Also the mean |trainer − engine| log-prob of each engine's own
batch under its trainer, the figure the mode makes 0. Prints a table, then one JSON object as the
last line; recorded as `results/true_on_policy.json`.

    python benchmarks/true_on_policy.py [--presets tiny small medium] [--rows 16] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from miles_core.config import RunConfig
from miles_core.data import TASKS
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import build_model, save_hf_dir
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch

MODES = ("plain", "invariant")


def requests(tok, rows: int, new: int) -> list[GenerateRequest]:
    prompts = [e.prompt for e in TASKS.get("reverse").generate(rows, seed=0)]
    return [
        GenerateRequest(
            input_ids=encode_prompt(tok, p),
            sampling_params=SamplingParams(max_new_tokens=new, sampling_seed=i, temperature=1.0),
        )
        for i, p in enumerate(prompts)
    ]


def as_batch(reqs, out) -> TrainBatch:
    rows = len(reqs)
    batch = TrainBatch(
        tokens=[r.input_ids + o.output_ids for r, o in zip(reqs, out, strict=True)],
        response_lengths=[len(o.output_ids) for o in out],
        loss_masks=[[1] * len(o.output_ids) for o in out],
        advantages=[float(i % 2) - 0.5 for i in range(rows)],
        rollout_log_probs=[o.output_log_probs for o in out],
        sample_ids=[str(i) for i in range(rows)],
    )
    batch.old_is_current = True
    return batch


def trainer(model_dir: str, invariant: bool, micro: int):
    cfg = RunConfig().train.model_copy(
        update={"micro_batch_size": micro, "lr": 1e-5, "true_on_policy": invariant}
    )
    if invariant:
        cfg = cfg.model_copy(update={"share_prompts": False})
    settings = cfg.model_dump()
    return BACKENDS.get("fsdp")(model_dir=model_dir, optim=settings, loss=settings)


def gap(t, batch: TrainBatch) -> float:
    rows = t.compute_log_probs(batch)
    return statistics.fmean(
        abs(a - b)
        for got, want in zip(rows, batch.rollout_log_probs, strict=True)
        for a, b in zip(got, want, strict=True)
    )


def measure(preset: str, rows: int, new: int, repeat: int, steps: int) -> dict:
    model, tok = build_model(preset, seed=0)
    engines = {
        m: ServingEngine(model, tok, seed=0, max_running=rows, true_on_policy=m == "invariant")
        for m in MODES
    }
    reqs = requests(tok, rows, new)
    tps: dict[str, list[float]] = {m: [] for m in MODES}
    outs = {}
    try:
        for m in MODES:  # warm-up
            outs[m] = engines[m].generate(reqs)
        for _ in range(repeat):
            for m in MODES:
                t0 = time.perf_counter()
                out = engines[m].generate(reqs)
                tps[m].append(sum(len(o.output_ids) for o in out) / (time.perf_counter() - t0))
    finally:
        for e in engines.values():
            e.close()
    with tempfile.TemporaryDirectory() as d:
        save_hf_dir(model, tok, d)
        trainers = {m: trainer(d, m == "invariant", rows) for m in MODES}
        gaps = {m: gap(trainers[m], as_batch(reqs, outs[m])) for m in MODES}
        batch = as_batch(reqs, outs["plain"])
        step_s: dict[str, list[float]] = {m: [] for m in MODES}
        for m in MODES:
            trainers[m].train_step(batch)  # warm-up
        for _ in range(steps):
            for m in MODES:
                t0 = time.perf_counter()
                trainers[m].train_step(batch)
                step_s[m].append(time.perf_counter() - t0)
    return {
        "tokens": sum(len(o.output_ids) for o in outs["plain"]),
        "tokens_per_s": {m: round(statistics.median(v), 1) for m, v in tps.items()},
        "step_s": {m: round(statistics.median(v), 4) for m, v in step_s.items()},
        "logprob_gap": gaps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "small", "medium"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    per = {}
    for preset in args.presets:
        per[preset] = measure(preset, args.rows, args.new, args.repeat, args.steps)
        r = per[preset]
        print(f"{preset}: {r}", flush=True)
    print(
        f"{'preset':8}{'tok/s plain':>13}{'tok/s mode':>12}{'engine ×':>10}"
        f"{'step s plain':>14}{'step s mode':>13}{'train ×':>9}{'gap plain':>11}{'gap mode':>10}"
    )
    for preset, r in per.items():
        t, s, g = r["tokens_per_s"], r["step_s"], r["logprob_gap"]
        print(
            f"{preset:8}{t['plain']:>13.1f}{t['invariant']:>12.1f}"
            f"{t['plain'] / t['invariant']:>10.2f}{s['plain']:>14.3f}{s['invariant']:>13.3f}"
            f"{s['invariant'] / s['plain']:>9.2f}{g['plain']:>11.2e}{g['invariant']:>10.2e}"
        )
    result = {
        "rows": args.rows,
        "max_new_tokens": args.new,
        "presets": per,
        "engine_cost": {
            p: round(r["tokens_per_s"]["plain"] / r["tokens_per_s"]["invariant"], 2)
            for p, r in per.items()
        },
        "train_cost": {
            p: round(r["step_s"]["invariant"] / r["step_s"]["plain"], 2) for p, r in per.items()
        },
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("true_on_policy", result)


if __name__ == "__main__":
    main()
