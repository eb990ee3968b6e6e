"""Routing replay (R3) on the small MoE preset: what replay costs in the train step, what the
engine's record weighs, and what replay changes in the trainer's log-probs, on the same batch.

One rollout batch from the serving engine in bf16 (`small-moe`, random init, `--rows` samples
of the `reverse` prompts, up to `--new` new tokens each, routes recorded), then the same batch
through three trainers of the same weights side by side (`--backend`: FSDP2 on the HF modules,
or Megatron with its RouterReplay hook, one rank): plain, replay, replay + checker.
Per trainer: 1 warm-up, then `--steps` timed optimizer steps, taken round-robin across the
trainers (policy loss; the median is reported). On the same batch, before any step: the trainer's routers against the engine's
record (`routing_mismatch_fraction`: (position, MoE layer) pairs whose expert set differs) and
|trainer − engine| log-probs of the response tokens, with and without replay; then once more
after one optimizer step (the record now comes from the previous weights, as after a weight push
under one-step-off or fully async). Record size: int32 bytes per token, measured against
(T − 1)·L·k·4. Prints a table, then one JSON object as the last line; recorded as
`results/routing_replay.json` (FSDP2) or `routing_replay_megatron.json`.

    python benchmarks/routing_replay.py [--backend fsdp|megatron] [--rows 32] [--new 48] [--steps 9]
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
from miles_core.models import build_model, moe, save_hf_dir
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.token_fields import declare_for_model
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch

PRESET = "small-moe"


def rollout(model, tok, rows: int, new: int) -> TrainBatch:
    """`rows` engine samples (bf16, routes recorded) as one training batch."""
    engine = ServingEngine(model, tok, seed=0, max_running=rows, dtype="bfloat16")
    prompts = [e.prompt for e in TASKS.get("reverse").generate(rows, seed=0)]
    requests = [
        GenerateRequest(
            input_ids=encode_prompt(tok, p),
            sampling_params=SamplingParams(max_new_tokens=new, sampling_seed=i, temperature=1.0),
            return_fields=[moe.ROUTES.name],
        )
        for i, p in enumerate(prompts)
    ]
    try:
        out = engine.generate(requests)
    finally:
        engine.close()
    batch = TrainBatch(
        tokens=[r.input_ids + o.output_ids for r, o in zip(requests, out, strict=True)],
        response_lengths=[len(o.output_ids) for o in out],
        loss_masks=[[1] * len(o.output_ids) for o in out],
        advantages=[float(i % 2) - 0.5 for i in range(rows)],
        rollout_log_probs=[o.output_log_probs for o in out],
        sample_ids=[str(i) for i in range(rows)],
        token_fields={"routed_experts": [o.token_fields["routed_experts"] for o in out]},
    )
    batch.old_is_current = True
    return batch


def trainer(model_dir: str, replay: bool, check: bool, backend: str):
    cfg = RunConfig().train.model_copy(
        update={
            "micro_batch_size": 8,
            "lr": 1e-5,  # an RL step's size: "one step on" is one weight push's worth
            "routing_replay": replay,
            "check_routing_replay": check,
            "share_prompts": False,  # the same padded rows in every variant
        }
    )
    settings = cfg.model_dump()
    return BACKENDS.get(backend)(model_dir=model_dir, optim=settings, loss=settings)


def logprob_diff(t, batch: TrainBatch) -> float:
    """Mean |trainer − engine| log-prob over the batch's response tokens."""
    rows = t.compute_log_probs(batch)
    diffs = [
        abs(a - b)
        for got, want in zip(rows, batch.rollout_log_probs, strict=True)
        for a, b in zip(got, want, strict=True)
    ]
    return statistics.fmean(diffs)


def probe(t, batch: TrainBatch) -> dict[str, float]:
    """On `batch`, with the trainer's current weights: the fraction of (position, MoE layer)
    pairs its routers choose apart from the record, and |Δ log-prob| without and with replay."""
    apart, checked = t.routing.totals
    plain = logprob_diff(t, batch)
    apart, checked = t.routing.totals[0] - apart, t.routing.totals[1] - checked
    t.routing.replay = True
    try:
        replayed = logprob_diff(t, batch)
    finally:
        t.routing.replay = False
    return {
        "mismatch": apart / max(checked, 1),
        "lp_diff_plain": plain,
        "lp_diff_replay": replayed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = build_model(PRESET, seed=0)
    with tempfile.TemporaryDirectory(prefix="miles-bench-r3-") as tmp:
        model_dir = str(save_hf_dir(model, tok, tmp))
        declare_for_model([moe.PATH], model.config.to_dict())  # what the responses carry
        t0 = time.perf_counter()
        batch = rollout(model, tok, args.rows, args.new)
        print(
            f"rollout: {len(batch.tokens)} samples in {time.perf_counter() - t0:.1f} s", flush=True
        )
        layers, top_k = moe.routes_shape(model.config.to_dict())["shape"]
        tokens = sum(len(x) for x in batch.tokens)
        record_bytes = sum(a.nbytes for a in batch.token_fields["routed_experts"])
        variants = {
            "plain": trainer(model_dir, False, False, args.backend),
            "replay": trainer(model_dir, True, False, args.backend),
            "replay+check": trainer(model_dir, True, True, args.backend),
        }
        # routes by itself, counts, replays on demand
        prober = trainer(model_dir, False, True, args.backend)
        before = probe(prober, batch)
        for t in variants.values():  # warm-up
            t.train_step(batch)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.steps):  # round-robin: a slow moment of the machine hits every one
            for name, t in variants.items():
                t1 = time.perf_counter()
                t.train_step(batch)
                times[name].append(time.perf_counter() - t1)
        step_s = {name: statistics.median(v) for name, v in times.items()}
        print("median train step: " + ", ".join(f"{k} {v:.3f} s" for k, v in step_s.items()))
        prober.train_step(batch)  # one step on: the record lags the weights by one version
        after = probe(prober, batch)
        for t in [*variants.values(), prober]:
            t.close()
    overhead = step_s["replay"] / step_s["plain"] - 1
    print(
        f"{PRESET} ({args.backend}): {len(batch.tokens)} rows, {tokens} tokens, {layers} MoE layers, top-{top_k}"
    )
    print(f"{'variant':14}{'step s':>9}{'vs plain':>10}")
    for name, s in step_s.items():
        print(f"{name:14}{s:>9.3f}{s / step_s['plain']:>10.3f}")
    print(f"{'':14}{'mismatch':>10}{'|Δlogp| plain':>15}{'|Δlogp| replay':>16}")
    for label, m in (("same weights", before), ("one step on", after)):
        print(
            f"{label:14}{m['mismatch']:>10.4f}{m['lp_diff_plain']:>15.5f}{m['lp_diff_replay']:>16.5f}"
        )
    print(
        f"record: {record_bytes / tokens:.1f} bytes per token ((T-1)·L·k·4 = {layers * top_k * 4} per position)"
    )
    result = {
        "backend": args.backend,
        "replay_overhead": round(overhead, 4),
        "step_s": {k: round(v, 4) for k, v in step_s.items()},
        "record_bytes_per_token": round(record_bytes / tokens, 2),
        "bytes_per_position": layers * top_k * 4,
        "same_weights": {k: round(v, 6) for k, v in before.items()},
        "one_step_on": {k: round(v, 6) for k, v in after.items()},
        "rows": len(batch.tokens),
        "tokens": tokens,
        "targets": {"replay_overhead": 0.05},
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    if args.backend == "megatron":
        record_result("routing_replay_megatron", result)
    else:
        record_result("routing_replay", result)


if __name__ == "__main__":
    main()
