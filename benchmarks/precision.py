"""What `rollout.precision` does to learning, to the rollout/trainer log-prob gap, to the bytes a
weight push moves and to engine speed, per format, side by side in one run.

1. Reward curves: say_a (tiny preset, examples/say_a.yaml, 40 steps) for every format, with
   the trainer in float (`qat off`: the engine serves quantized weights, the trainer computes
   with float ones) and with `train.qat` (`qat on`), against two baselines with the same seeds:
   fp32 and bf16 (weights pushed in bf16, `weight_sync.dtype`). `--seeds` seeds each; per step
   the mean reward over seeds. A format's curve is within tolerance when it never leaves the
   bf16 curve by more than 3σ of the difference of two such means at p = 0.5:
   3·sqrt(2 · 0.25 / (samples per step · seeds)) (0.108 for 128 samples, 3 seeds). Also the
   gap train/train_rollout_logprob_abs_diff, mean over all steps and seeds.
   Then reverse (small preset, examples/reverse_sft_rl.yaml): one SFT warm start per seed,
   shared by every format, then its RL phase per format with `train.qat`.
2. Bytes a push moves per format (small preset), and the time to quantize them on the trainer
   side and to load them (dequantize) on the engine side, median of `--repeat` (measured first,
   like 3).
3. Serving-engine decode throughput (small preset, `--rows` samples of up to `--new` tokens):
   the CPU emulation computes with the dequantized weights in float32, so it decodes at fp32
   speed; low-precision GEMMs need a GPU kernel (not measured here).

Prints tables, then one JSON object as the last line; recorded as `results/precision.json`.

    python benchmarks/precision.py [--seeds 0 1 2] [--reverse-seeds 0] [--skip-curves]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles_core.config import load_config
from miles_core.data import TASKS
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import build_model
from miles_core.precision.plan import QuantPlan
from miles_core.precision.push import QuantizedSource
from miles_core.precision.served import ServedWeights
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.run import runtime
from miles_core.weights.source import TensorBuckets

FORMATS = {
    "fp8": [],
    "fp8_block": [],
    "mxfp8": [],
    "mxfp4": [],
    "nvfp4": [],
    "int4": ["rollout.precision_options.group_size=32"],  # the tiny preset's dims: 64, 192
}
BASELINES = {"fp32": [], "bf16": ["weight_sync.dtype=bfloat16"]}
REPO = Path(__file__).resolve().parents[1]


def variants(qat: bool = True, plain: bool = True) -> dict[str, list[str]]:
    out = dict(BASELINES)
    for f, opts in FORMATS.items():
        if plain:
            out[f"{f}"] = [f"rollout.precision={f}", *opts]
        if qat:
            out[f"{f}+qat"] = [f"rollout.precision={f}", "train.qat=true", *opts]
    return out


def rl_run(example: str, sets: list[str], model_path: str | None = None) -> dict:
    """One RL run in this process: per-step mean reward and log-prob gap."""
    tmp = Path(tempfile.mkdtemp())
    config = load_config(str(REPO / example), [f"checkpoint.root={tmp / 'ckpt'}", *sets])
    if model_path is not None:
        config = config.with_model_path(model_path)
    rt = runtime.RLRuntime(config, runtime.prepare_model_dir(config, tmp / "init"), None)
    rewards, gaps = [], []
    try:
        for step in range(config.train.num_steps):
            result = rt.rollout(step)
            metrics = rt.train(result)
            rewards.append(statistics.fmean(s.reward for s in result.samples))
            gaps.append(metrics["train/train_rollout_logprob_abs_diff"])
            rt.update_weights()
    finally:
        rt.close()
    return {"rewards": rewards, "gaps": gaps}


def sft_start(seed: int) -> str:
    """The reverse example's SFT warm start for `seed` (its saved HF directory)."""
    from miles_core.train.sft import run_sft

    tmp = Path(tempfile.mkdtemp())
    config = load_config(
        str(REPO / "examples/reverse_sft_rl.yaml"), [f"checkpoint.root={tmp}", f"seed={seed}"]
    )
    return run_sft(config, runtime.prepare_model_dir(config, tmp / "init"), None)


def curves(example: str, names: dict[str, list[str]], seeds: list[int], starts=None) -> dict:
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for seed in seeds:  # every variant of one seed, then the next: same machine state per seed
        for name, sets in names.items():
            t0 = time.time()
            start = starts[seed] if starts else None
            r = rl_run(example, [f"seed={seed}", *sets], start)
            runs[name].append(r)
            print(f"  {example} seed {seed} {name}: last-5 reward "
                  f"{statistics.fmean(r['rewards'][-5:]):.3f} ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
    return runs


def summarize(runs: dict[str, list[dict]], samples: int, baseline: str = "bf16") -> dict:
    seeds = len(next(iter(runs.values())))
    tol = 3 * math.sqrt(2 * 0.25 / (samples * seeds))
    mean = {n: [statistics.fmean(c) for c in zip(*(r["rewards"] for r in rs), strict=True)]
            for n, rs in runs.items()}  # fmt: skip
    out = {}
    for name, rs in runs.items():
        dev = max(abs(a - b) for a, b in zip(mean[name], mean[baseline], strict=True))
        out[name] = {
            "final_reward": round(statistics.fmean(mean[name][-5:]), 3),
            "max_dev_from_" + baseline: round(dev, 3),
            "within_tolerance": dev <= tol,
            "gap_mean": float(f"{statistics.fmean(g for r in rs for g in r['gaps']):.3g}"),
            "curve": [round(x, 3) for x in mean[name]],
        }
    return {"tolerance": round(tol, 3), "seeds": seeds, "variants": out}


def push_costs(repeat: int) -> dict:
    model, _ = build_model("small", seed=0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    for name in ["fp32", "bf16", *FORMATS]:
        if name in ("fp32", "bf16"):
            dtype = torch.bfloat16 if name == "bf16" else None
            pushed = [(n, t if dtype is None else t.to(dtype)) for n, t in weights.items()]
            out[name] = {"bytes": sum(t.numel() * t.element_size() for _, t in pushed)}
            continue
        opts = {"group_size": 128} if name == "int4" else {}
        spec = {"format": name, "options": opts, "keep_bf16": {"modules": ["lm_head", "router"]}}
        plan = QuantPlan.from_spec(spec, 4)
        served = ServedWeights({n: t.clone() for n, t in weights.items()}, plan)
        quantize, load = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            pushed = [nt for b in QuantizedSource(TensorBuckets(weights), plan).named_weights()
                      for nt in b]  # fmt: skip
            t1 = time.perf_counter()
            served.load(pushed)
            load.append(time.perf_counter() - t1)
            quantize.append(t1 - t0)
        out[name] = {
            "bytes": sum(t.numel() * t.element_size() for _, t in pushed),
            "quantize_ms": round(1e3 * statistics.median(quantize), 1),
            "load_ms": round(1e3 * statistics.median(load), 1),
        }
    return out


def engine_speed(rows: int, new: int, repeat: int) -> dict:
    out = {}
    prompts = [e.prompt for e in TASKS.get("reverse").generate(rows, seed=0)]
    for name in ["fp32", "bf16 compute", *FORMATS]:
        model, tok = build_model("small", seed=0)
        spec = None
        if name in FORMATS:
            opts = {"group_size": 128} if name == "int4" else {}
            spec = {"format": name, "options": opts, "keep_bf16": {"modules": ["lm_head"]}}
        dtype = "bfloat16" if name == "bf16 compute" else "float32"
        engine = ServingEngine(model, tok, seed=0, max_running=rows, dtype=dtype,
                               scheduler="caller", precision=spec)  # fmt: skip
        reqs = [GenerateRequest(input_ids=encode_prompt(tok, p),
                                sampling_params=SamplingParams(max_new_tokens=new, sampling_seed=i,
                                                               ignore_eos=True))
                for i, p in enumerate(prompts)]  # fmt: skip
        times = []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            got = engine.generate(reqs)
            if i:
                times.append(time.perf_counter() - t0)
        tokens = sum(len(r.output_ids) for r in got)
        out[name] = round(tokens / statistics.median(times))
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--reverse-seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--skip-curves", action="store_true", help="only bytes and speed")
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"machine_isa": torch.backends.cpu.get_cpu_capability()}
    # the timed parts first, in a fresh process (the runs below leave the thread count they
    # chose for the engine)
    result["push"] = push_costs(args.repeat)
    result["engine_tokens_per_s"] = engine_speed(args.rows, args.new, args.repeat)
    print(json.dumps({k: result[k] for k in ("push", "engine_tokens_per_s")}), flush=True)
    if not args.skip_curves:
        say_a = curves("examples/say_a.yaml", variants(), args.seeds)
        result["say_a"] = summarize(say_a, 128)
        if args.reverse_seeds:
            starts = {s: sft_start(s) for s in args.reverse_seeds}
            names = variants(plain=False)
            rev = curves("examples/reverse_sft_rl.yaml", names, args.reverse_seeds, starts)
            result["reverse"] = summarize(rev, 128)

    for task in ("say_a", "reverse"):
        if task not in result:
            continue
        s = result[task]
        print(f"\n{task}: {s['seeds']} seed(s), tolerance ±{s['tolerance']} of the bf16 curve")
        print(f"{'variant':<12} {'final':>6} {'max dev':>8} {'within':>7} {'gap (mean)':>11}")
        for n, v in s["variants"].items():
            dev = v[next(k for k in v if k.startswith("max_dev"))]
            print(f"{n:<12} {v['final_reward']:>6.3f} {dev:>8.3f} {str(v['within_tolerance']):>7} "
                  f"{v['gap_mean']:>11.3g}")  # fmt: skip
    print(
        f"\n{'format':<12} {'push MB':>8} {'quantize ms':>12} {'load ms':>8} {'engine tok/s':>13}"
    )
    speed = result["engine_tokens_per_s"]
    for n, p in result["push"].items():
        tps = speed.get(n, speed.get("fp32") if n == "fp32" else "")
        print(f"{n:<12} {p['bytes'] / 1e6:>8.2f} {p.get('quantize_ms', ''):>12} "
              f"{p.get('load_ms', ''):>8} {tps:>13}")  # fmt: skip
    print(f"{'bf16 compute':<12} {'':>8} {'':>12} {'':>8} {speed['bf16 compute']:>13}")
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("precision", result)


if __name__ == "__main__":
    main()
