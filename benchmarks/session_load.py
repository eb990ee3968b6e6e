"""Load on the session server: N concurrent agent sessions (default 256) against one engine
server on this machine, each a multi-turn chat, every request answered or counted as an error.
Prints latency percentiles per chat turn, then one JSON object.

    python benchmarks/session_load.py [--sessions 256] [--turns 4] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from miles_core.engines.http import EngineProcess
from miles_core.models import build_model, save_hf_dir
from miles_core.sessions import SessionServerProcess


async def one_session(
    http: aiohttp.ClientSession, k: int, turns: int, max_tokens: int, out: dict
) -> None:
    try:
        async with http.post("/sessions", json={"metadata": {"k": k}}) as r:
            sid = (await r.json())["session_id"]
        messages = [{"role": "user", "content": f"session {k}: say a"}]
        for t in range(turns):
            t0 = time.perf_counter()
            body = {"messages": messages, "max_tokens": max_tokens, "seed": k * 100 + t}
            async with http.post(f"/sessions/{sid}/v1/chat/completions", json=body) as r:
                status, data = r.status, await r.json()
            out["latency"].append(time.perf_counter() - t0)
            if status != 200:
                out["errors"].append(f"{status}: {str(data)[:120]}")
                return
            reply = data["choices"][0]["message"]
            messages += [
                {"role": "assistant", "content": reply["content"] or ""},
                {"role": "user", "content": f"turn {t}"},
            ]
        async with http.get(f"/sessions/{sid}") as r:
            info = await r.json()
        out["leaves"].append(info["leaves"])
        out["mismatched"].append(info["tito_token_edits"])
    except (aiohttp.ClientError, TimeoutError) as e:
        out["errors"].append(repr(e))


async def drive(url: str, sessions: int, turns: int, max_tokens: int) -> dict:
    out = {"latency": [], "errors": [], "leaves": [], "mismatched": []}
    connector = aiohttp.TCPConnector(limit=sessions * 2)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(one_session(http, k, turns, max_tokens, out) for k in range(sessions))
        )
        out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="miles-load-"))
    model, tok = build_model("tiny", seed=0)
    model.config.max_position_embeddings = 1024
    model_dir = save_hf_dir(model, tok, tmp / "model")
    running = str(args.sessions)
    engine = EngineProcess(model_dir, args=["--max-running", running], log_path=tmp / "e.log")
    engine.start()
    server = SessionServerProcess(engine.url, "tiny", log_path=tmp / "s.log")
    try:
        server.start()
        out = asyncio.run(drive(server.url, args.sessions, args.turns, args.max_tokens))
        metrics = httpx.get(f"{server.url}/metrics").json()
    finally:
        server.stop()
        engine.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lat = sorted(out["latency"])

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    print(
        f"{args.sessions} concurrent sessions × {args.turns} turns (≤ {args.max_tokens} new "
        f"tokens each), one engine server + one session server on this machine"
    )
    print(
        f"{'requests':>10}{'errors':>8}{'p50 s':>8}{'p90 s':>8}{'p99 s':>8}{'max s':>8}{'turns/s':>9}"
    )
    print(
        f"{len(lat):>10}{len(out['errors']):>8}{pct(0.5):>8.2f}{pct(0.9):>8.2f}{pct(0.99):>8.2f}"
        f"{lat[-1] if lat else float('nan'):>8.2f}{len(lat) / out['seconds']:>9.1f}"
    )
    for e in out["errors"][:5]:
        print("error:", e)
    result = {
        "sessions": args.sessions,
        "turns": args.turns,
        "requests": len(lat),
        "errors": len(out["errors"]),
        "latency_s": {
            "p50": round(pct(0.5), 3),
            "p90": round(pct(0.9), 3),
            "p99": round(pct(0.99), 3),
            "max": round(lat[-1], 3) if lat else None,
            "mean": round(statistics.fmean(lat), 3) if lat else None,
        },
        "turns_per_s": round(len(lat) / out["seconds"], 2),
        "wall_s": round(out["seconds"], 2),
        "branches": metrics.get("branches"),
        "tito_token_edits": metrics.get("tito_token_edits"),
        "single_leaf_sessions": sum(1 for n in out["leaves"] if n == 1),
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("session_load", result)


if __name__ == "__main__":
    main()
