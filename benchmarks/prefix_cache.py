"""Prefix-cache hit rate of a multi-turn workload on the serving engine.

8 concurrent sessions share a long system prompt; each runs 10 turns, and every turn's prompt is
the previous prompt + the model's reply (token ids as generated) + a short new user message, i.e.
what a TITO session sends. The same workload runs with prefix reuse on and off, side by side;
hit rate = prompt tokens served from the cache / all prompt tokens (SGLang's `cached_tokens`).
Prints a table, then one JSON object as the last line.

    python benchmarks/prefix_cache.py [--sessions 8] [--turns 10] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

import miles_core  # noqa: F401
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import build_tokenizer
from miles_core.models.builder import preset_config

CONTEXT = 2048


def build(preset: str):
    tok = build_tokenizer()
    cfg = preset_config(preset, len(tok), tok.pad_token_id, tok.eos_token_id)
    cfg.max_position_embeddings = CONTEXT
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval(), tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(model, tok, sessions: int, turns: int, reply_tokens: int, prefix_cache: bool) -> dict:
    rng = random.Random(0)
    engine = ServingEngine(
        model,
        tok,
        seed=0,
        max_running=sessions,
        cache_slots=2 * sessions,
        max_len=CONTEXT,
        prefix_cache=prefix_cache,
    )
    system = "You are a terminal agent. " * 40  # ≈1000 tokens shared by every session
    histories = [encode(tok, f"<|im_start|>system\n{system}<|im_end|>\n") for _ in range(sessions)]
    per_turn = []
    t0 = time.perf_counter()
    for turn in range(turns):
        prompts = []
        for s in range(sessions):
            user = f"<|im_start|>user\nstep {turn} {rng.choice(['ls', 'cat a', 'make'])}<|im_end|>\n<|im_start|>assistant\n"
            histories[s] = histories[s] + encode(tok, user)
            prompts.append(list(histories[s]))
        reqs = [
            GenerateRequest(
                input_ids=p,
                sampling_params=SamplingParams(
                    max_new_tokens=reply_tokens, sampling_seed=1000 * turn + s
                ),
            )
            for s, p in enumerate(prompts)
        ]
        out = engine.generate(reqs, timeout=600)
        cached = sum(r.meta_info.cached_tokens for r in out)
        prompt = sum(r.meta_info.prompt_tokens for r in out)
        per_turn.append(cached / prompt)
        for s, r in enumerate(out):
            histories[s] = histories[s] + r.output_ids + encode(tok, "<|im_end|>\n")
    seconds = time.perf_counter() - t0
    result = {
        "hit_rate": engine.prefix_cache_hit_rate(),
        "per_turn": per_turn,
        "seconds": seconds,
        "prompt_tokens": engine.stats["prompt_tokens"],
        "final_context": max(len(h) for h in histories),
    }
    engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--preset", default="small")
    args = ap.parse_args()
    model, tok = build(args.preset)
    on = run(model, tok, args.sessions, args.turns, args.reply_tokens, prefix_cache=True)
    off = run(model, tok, args.sessions, args.turns, args.reply_tokens, prefix_cache=False)
    print(f"{'prefix cache':14}{'hit rate':>10}{'seconds':>10}{'prompt tokens':>15}")
    for name, r in (("on", on), ("off", off)):
        print(f"{name:14}{r['hit_rate']:>10.4f}{r['seconds']:>10.2f}{r['prompt_tokens']:>15}")
    print("per-turn hit rate (on): " + " ".join(f"{x:.3f}" for x in on["per_turn"]))
    result = {
        "prefix_cache_hit_rate": round(on["hit_rate"], 4),
        "hit_rate_by_turn": [round(x, 4) for x in on["per_turn"]],
        "speedup_from_prefix_cache": round(off["seconds"] / on["seconds"], 3),
        "seconds": {"on": round(on["seconds"], 3), "off": round(off["seconds"], 3)},
        "prompt_tokens": on["prompt_tokens"],
        "sessions": args.sessions,
        "turns": args.turns,
        "final_context_tokens": on["final_context"],
        "preset": args.preset,
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("prefix_cache", result)


if __name__ == "__main__":
    main()
