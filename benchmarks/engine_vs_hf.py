"""Decode throughput of our engines against transformers' `generate`, side by side in one run.

Workload (per preset): 32 prompts of 16 tokens, 64 new tokens each (no stop token can end them
early: `min_new_tokens` for `generate`, no stop ids for ours), temperature-1 sampling with
per-token log-probs. Engines: HF `generate` (fp32), the embedded engine (HF modules +
DynamicCache), the serving engine in process (lean forward, slot KV cache, continuous batching;
fp32 and bf16 GEMMs) and behind its HTTP server (a subprocess on 127.0.0.1, 32 concurrent
requests; fp32 and bf16). One warm-up, then interleaved repetitions; the median is reported.
`ceiling_vs_hf_generate`: the same GEMMs and attention alone (`compute_floor`), against `generate`:
the most an engine computing through these kernels can reach on this machine.
Prints a table, then one JSON object.

    python benchmarks/engine_vs_hf.py [--presets small,medium] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import miles_core  # noqa: F401
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import build_model, save_hf_dir
from miles_core.models.qwen3.runner import Qwen3Runner

BATCH, PROMPT, NEW = 32, 16, 64
DTYPES = ("float32", "bfloat16")


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (BATCH, PROMPT), generator=g).tolist()


def requests(ids: list[list[int]]) -> list[GenerateRequest]:
    return [
        GenerateRequest(input_ids=p, sampling_params=SamplingParams(max_new_tokens=NEW))
        for p in ids
    ]


def compute_floor(runner: Qwen3Runner) -> Callable[[], None]:
    """The workload's GEMMs (the runner's own packed weights and fused epilogues) and attention
    (SDPA at each step's key length), and nothing else: no norms, RoPE, cache writes, sampling or
    Python scheduling. HF `generate` does at least this much work (the same GEMM shapes, in
    fp32), so `hf_generate_s / floor_s` bounds what any engine that computes through these
    kernels on this machine can reach (`ceiling_vs_hf_generate`)."""
    cfg, w = runner.cfg, runner._weights()
    d, inter = cfg.hidden_size, cfg.intermediate_size
    nh, nkv, hd = runner.n_heads, runner.n_kv, runner.head_dim
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=runner.dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    shapes = [(BATCH * PROMPT, PROMPT, PROMPT)]  # prefill: rows, query length, key length
    shapes += [(BATCH, 1, PROMPT + i + 1) for i in range(NEW - 1)]  # decode steps
    inputs = []
    for rows, q_len, k_len in shapes:
        mask = torch.ones(BATCH, 1, q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        inputs.append(
            (
                rand(rows, d),
                rand(rows, inter),
                rand(BATCH, nh, q_len, hd, dtype=torch.float32),
                rand(BATCH, nkv, k_len, hd, dtype=torch.float32),
                mask,
            )
        )

    def run() -> None:
        with torch.inference_mode():
            for x, h, q, kv, mask in inputs:
                for lw in w.layers:
                    runner._mm(x, lw.qkv)
                    F.scaled_dot_product_attention(
                        q, kv, kv, attn_mask=mask, scale=runner.scaling, enable_gqa=nh != nkv
                    )
                    runner._mm_add(x, x, lw.o)
                    runner._mm_mul(x, runner._mm_silu(x, lw.gate), lw.up)
                    runner._mm_add(h, x, lw.down)
                runner._mm(x[:BATCH], w.lm_head)

    return run


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(preset: str, reps: int) -> dict[str, float]:
    model, tok = build_model(preset, seed=0)
    ids = prompts(model.config.vocab_size)
    reqs = requests(ids)
    embedded = EmbeddedEngine(model, tok)
    serving = {
        dtype: ServingEngine(model, tok, max_running=BATCH, scheduler="caller", dtype=dtype)
        for dtype in DTYPES
    }
    input_ids = torch.tensor(ids)

    def hf():
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=tok.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(model, tok, tmp)
        args = ["--max-running", str(BATCH)]
        with contextlib.ExitStack() as stack:
            clients = {}
            for dtype in DTYPES:
                proc = stack.enter_context(EngineProcess(tmp, args=[*args, "--dtype", dtype]))
                # BATCH requests in flight at once, plus one connection for the client's /health
                # watchdog: with exactly BATCH the watchdog waits for a free connection and, on a
                # loaded machine, counts the wait as failed health checks (PoolTimeout)
                clients[dtype] = HttpEngine(proc.url, concurrency=BATCH + 1)
                stack.callback(clients[dtype].close)
            variants = {"hf_generate": hf, "embedded": lambda: embedded.generate(reqs)}
            for dtype in DTYPES:
                variants[f"in_process_{dtype}"] = functools.partial(serving[dtype].generate, reqs)
                variants[f"http_{dtype}"] = functools.partial(clients[dtype].generate, reqs)
            for dtype in DTYPES:
                variants[f"floor_{dtype}"] = compute_floor(serving[dtype].runner)
            for fn in variants.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(reps):
                for name, fn in variants.items():
                    times[name].append(timed(fn))
    for engine in serving.values():
        engine.close()
    tokens = BATCH * NEW
    return {name: tokens / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    measured = {p: bench(p, args.reps) for p in args.presets.split(",")}
    results = {
        p: {k: v for k, v in r.items() if not k.startswith("floor_")} for p, r in measured.items()
    }
    ceilings = {
        p: {d: round(r[f"floor_{d}"] / r["hf_generate"], 3) for d in DTYPES}
        for p, r in measured.items()
    }
    names = list(next(iter(results.values())))
    print(f"{'preset':8}" + "".join(f"{n:>20}" for n in names) + "   (tokens/s)")
    for p, r in results.items():
        print(f"{p:8}" + "".join(f"{r[n]:>20.0f}" for n in names))
    print(f"{'preset':8}" + "".join(f"{n:>20}" for n in names[1:]) + "   (× hf_generate)")
    for p, r in results.items():
        print(f"{p:8}" + "".join(f"{r[n] / r['hf_generate']:>20.2f}" for n in names[1:]))
    print(
        f"{'preset':8}"
        + "".join(f"{d:>20}" for d in DTYPES)
        + "   (ceiling: GEMMs + attention alone)"
    )
    for p, c in ceilings.items():
        print(f"{p:8}" + "".join(f"{c[d]:>20.2f}" for d in DTYPES))
    result = {
        "speedup_vs_hf_generate": {
            p: {n: round(r[n] / r["hf_generate"], 3) for n in names[1:]} for p, r in results.items()
        },
        "ceiling_vs_hf_generate": ceilings,
        "tokens_per_s": {p: {k: round(v) for k, v in r.items()} for p, r in results.items()},
        "workload": {
            "batch": BATCH,
            "prompt_tokens": PROMPT,
            "new_tokens": NEW,
            "hf_dtype": "float32",
            "threads": torch.get_num_threads(),
        },
        "target": 3.0,
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("engine_vs_hf", result)


if __name__ == "__main__":
    main()
