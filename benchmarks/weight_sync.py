"""GB/s of each weight transport against a plain memcpy of the same tensors, in one run.

A LoRA row: a rank-8 adapter's push (colocated and shared memory), its bytes against the full
model's, bitwise on the engine.

For each preset: memcpy (one `copy_` of every tensor into preallocated storage: the floor any
transport pays at least once), colocated (in-process engine), then shared_memory, broadcast
(gloo), p2p (from a 1-rank FSDP trainer's own shards) and disk (an engine server subprocess on
127.0.0.1). Pushes use the runs' default pause
mode, retract. Each push is verified bitwise (checksum over HTTP) outside the timed region.
Median of `--reps` pushes after one warm-up. Prints a table, then one JSON object.

The group transports are also measured against their own wire limit, in the same processes and
group: `broadcast_raw` is the plain `torch.distributed` broadcast of the same bytes (the flat
buffer of each bucket, as the transport's wire splits it) from this process to the engine
server, and `p2p_raw` the plain send of the same bytes from the trainer's rank over the trainer's
own p2p group; the engine receives them into buffers kept from the last probe and drops them
(`load_format: wire_probe`, weights/receiver.py). Timed on the sender from a one-element
broadcast that both sides pass until the last send returns, so no HTTP, pause, flattening or
load is in them. `fraction_of_raw` = transport GB/s / raw GB/s. `flatten` is the copy of each
bucket into one flat buffer per dtype (kept buffers, as the transports do); a push pays it on
top of the wire, so `flatten_bound_of_raw` = raw time / (raw + flatten time) is what a push that
flattens once can reach of the raw wire. Likewise `shared_memory_bound` = memcpy time / (memcpy +
one HTTP round trip to the engine server): a same-host push writes the bytes once and makes at
least one call.

    python benchmarks/weight_sync.py [--presets small,medium] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.models import build_model, save_hf_dir
from miles_core.weights import TRANSPORTS, mismatched_tensors, weights_checksum
from miles_core.weights.group import Scratch, broadcast, send_flat
from miles_core.weights.receiver import PROBE_FORMAT
from miles_core.weights.source import TensorBuckets, dtype_name
from miles_core.weights.transports.disk import DiskTransport

COMPARED = ("colocated", "shared_memory", "broadcast", "p2p", "disk")
RAW = {"broadcast": "broadcast_raw", "p2p": "p2p_raw"}  # each group transport's wire limit


def buckets(named: dict[str, torch.Tensor], bucket_bytes: int = 64 << 20) -> TensorBuckets:
    out, cur, size = [], [], 0
    for name, t in named.items():
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return TensorBuckets(out + ([cur] if cur else []))


def bench(preset: str, reps: int) -> dict[str, float]:
    model, tok = build_model(preset, seed=0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    results: dict[str, float] = {}

    dst = {n: torch.empty_like(t) for n, t in weights.items()}

    def memcpy() -> None:
        for n, t in weights.items():
            dst[n].copy_(t)

    results["memcpy"] = nbytes / _median(memcpy, reps) / 1e9
    # what a group push adds to the wire at least: each bucket flattened into a kept buffer
    scratch = Scratch()

    def flatten() -> None:
        scratch.start()
        for bucket in buckets(weights).buckets:
            _flats(bucket, scratch)

    results["flatten"] = nbytes / _median(flatten, reps) / 1e9

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(model, tok, tmp)
        engine_model, _ = build_model(preset, seed=1)
        colocated = EmbeddedEngine(engine_model, tok)
        with EngineProcess(tmp, args=["--threads", "1"], weight_roots=[tmp]) as proc:
            server = HttpEngine(proc.url)
            # one control round trip to the engine server: a same-host push makes at least one
            results["round_trip_s"] = _median(server.server_info, 4 * reps)
            for name in COMPARED:
                if name == "p2p":  # sends from the trainer's own shards: a 1-rank FSDP trainer
                    results[name], results["p2p_raw"] = p2p_gbps(tmp, server, nbytes, reps)
                    continue
                if name == "disk":
                    transport = DiskTransport(root=str(Path(tmp) / "pushed"), keep=1)
                else:
                    transport = TRANSPORTS.get(name)()
                target = colocated if name == "colocated" else server
                transport.connect([target])
                version = [0]

                def push(transport=transport, version=version) -> None:
                    version[0] += 1
                    transport.push(buckets(weights), version=version[0], pause_mode="retract")

                results[name] = nbytes / _median(push, reps) / 1e9
                if name == "broadcast":  # the same bytes, the same group: the wire alone
                    results["broadcast_raw"] = (
                        nbytes / raw_broadcast_s(transport, weights, reps) / 1e9
                    )
                if name == "colocated":
                    assert not mismatched_tensors(weights.items(), colocated.named_tensors())
                else:
                    assert server.weights_checksum() == weights_checksum(weights.items())
                getattr(transport, "close", lambda: None)()
            server.close()
    results["bytes"] = float(nbytes)
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    results["delta_bytes_fraction"] = delta_fraction(model, torch.bfloat16)
    model.load_state_dict(state)  # the same AdamW step again, for fp32 pushes
    results["delta_bytes_fraction_fp32"] = delta_fraction(model, torch.float32)
    model.load_state_dict(state)
    results["delta_bytes_fraction_step10"] = delta_fraction(model, torch.bfloat16, warm=9)
    results |= lora_push(preset, reps)
    return results


LORA_TARGETS = {  # train.lora.target_modules of the LoRA rows
    "all-linear": "all-linear",
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def lora_push(preset: str, reps: int, rank: int = 8) -> dict[str, float]:
    """A LoRA run's push (train.lora rank `rank`, on every linear layer and on the attention
    projections): the adapter alone, through colocated and shared memory, bitwise on the engine
    after each push; its bytes against the full model's."""
    from miles_core.config.lora import LoraSettings
    from miles_core.lora.adapter import engine_spec
    from miles_core.lora.names import wire_name
    from miles_core.lora.targets import linear_modules

    model, tok = build_model(preset, seed=0)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = linear_modules(model)
    gen = torch.Generator().manual_seed(0)
    spec: dict = {"adapters": {}, "max_loaded": 8, "required": True}
    adapters = {}
    for variant, targets in LORA_TARGETS.items():
        declared = engine_spec(LoraSettings(rank=rank, target_modules=targets), model)
        config = declared["adapters"]["default"]
        spec["adapters"][variant] = config
        adapters[variant] = {}
        for module in config["target_modules"]:
            out_f, in_f = shapes[module]
            a, b = torch.randn(rank, in_f, generator=gen), torch.randn(out_f, rank, generator=gen)
            adapters[variant][wire_name(variant, module, "lora_A")] = a
            adapters[variant][wire_name(variant, module, "lora_B")] = b
    results: dict[str, float] = {}
    # what the engines hold before the pushes: every declared adapter's zeros
    held = {n: torch.zeros_like(t) for tensors in adapters.values() for n, t in tensors.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(model, tok, tmp)
        colocated = EmbeddedEngine(build_model(preset, seed=1)[0], tok, lora=spec)
        args = ["--threads", "1", "--lora", json.dumps(spec)]
        with EngineProcess(tmp, args=args) as proc:
            server = HttpEngine(proc.url)
            for variant, tensors in adapters.items():
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                results[f"lora_{variant}_bytes"] = float(nbytes)
                results[f"lora_{variant}_fraction"] = nbytes / full
                for name, target in (("colocated", colocated), ("shared_memory", server)):
                    transport = TRANSPORTS.get(name)()
                    transport.connect([target])
                    stats = transport.push(buckets(tensors), version=1, pause_mode="retract")
                    assert stats.bytes == nbytes  # the adapter's bytes, nothing else
                    served = {**held, **tensors}  # the engine's adapters: this one replaced
                    assert target.weights_checksum("adapters") == weights_checksum(served.items())
                    results[f"lora_{variant}_{name}_s"] = _median(
                        lambda t=transport, x=tensors: t.push(buckets(x), version=2), reps
                    )
                    getattr(transport, "close", lambda: None)()
                held |= tensors
            server.close()
    return results


def delta_fraction(
    model: torch.nn.Module, dtype: torch.dtype, lr: float = 1e-5, warm: int = 0
) -> float:
    """Bytes of a disk delta after one AdamW step at `lr` / bytes of the full push before it,
    for pushes in `dtype` (weight_sync.dtype). The step is Adam's first (its largest: every
    element with a gradient moves by lr) unless `warm` steps on other batches come before it."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    for _ in range(warm):
        step()
    with tempfile.TemporaryDirectory() as tmp:
        transport = DiskTransport(root=tmp, keep=2, delta=True)
        transport.connect([])  # write only
        named = lambda: {n: p.detach().to(dtype) for n, p in model.named_parameters()}  # noqa: E731
        transport.push(buckets(named()), version=1)
        full = _dir_bytes(Path(tmp) / "weight_v000001")
        step()
        transport.push(buckets(named()), version=2)
        return _dir_bytes(Path(tmp) / "weight_v000002") / full


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def _probe_body(bucket: list[tuple[str, torch.Tensor]], group_name: str, **extra) -> dict:
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "load_format": PROBE_FORMAT,
        **extra,
    }


def _flats(bucket: list[tuple[str, torch.Tensor]], scratch: Scratch | None = None) -> list:
    """The bucket's bytes as the wire carries them: one flat buffer per dtype (sorted), in
    `scratch`'s kept buffers if given (as the transports flatten them)."""
    out = []
    for d in sorted({dtype_name(t.dtype) for _, t in bucket}):
        parts = [t.reshape(-1) for _, t in bucket if dtype_name(t.dtype) == d]
        n = sum(p.numel() for p in parts)
        into = None if scratch is None else scratch.take(n, parts[0].dtype)
        out.append(torch.cat(parts) if into is None else torch.cat(parts, out=into))
    return out


def _raw_median(transport, pg, bodies: list[dict], send, reps: int) -> float:
    """Median seconds of the raw wire for all of `bodies` (one probe call per body): the engine
    enters its receive over HTTP, both pass a one-element broadcast, then `send(i)` alone is
    timed on this side."""

    def once() -> float:
        total = 0.0
        for i, body in enumerate(bodies):
            call = transport._pool.submit(transport.engines[0].post, PATH, body)
            broadcast(pg, torch.zeros(1))
            t0 = time.perf_counter()
            send(i)
            total += time.perf_counter() - t0
            call.result(timeout=120)
        return total

    once()  # warm-up: the engine allocates its probe buffers
    return statistics.median(once() for _ in range(reps))


PATH = "/update_weights_from_distributed"


def raw_broadcast_s(transport, weights: dict[str, torch.Tensor], reps: int) -> float:
    """A plain broadcast of each bucket's flat buffers (the bench's bucket shapes) over the
    broadcast transport's own group."""
    pushed = buckets(weights).buckets
    bodies = [_probe_body(b, transport.group_name) for b in pushed]
    flats = [_flats(b) for b in pushed]
    pg = transport.group[1]

    def send(i: int) -> None:
        for flat in flats[i]:
            broadcast(pg, flat)

    return _raw_median(transport, pg, bodies, send, reps)


def raw_send_s(transport, trainer, reps: int) -> float:
    """A plain send of the trainer's bytes (one flat buffer per dtype) from its rank 0 to the
    engine over the trainer's own p2p group (rank 1: the engine after one trainer rank)."""
    whole = [x for b in trainer.named_weights(64 << 20) for x in b]
    flats = _flats(whole)
    pg = trainer._transfer_group[1]  # the group the p2p pushes just used

    def send(_: int) -> None:
        works = [w for tag, flat in enumerate(flats) for w in send_flat(pg, flat, 1, tag)]
        for w in works:
            w.wait()

    body = _probe_body(whole, transport.group_name, senders=1)
    return _raw_median(transport, pg, [body], send, reps)


def p2p_gbps(model_dir: str, server: HttpEngine, nbytes: int, reps: int) -> tuple[float, float]:
    from miles_core.config import RunConfig
    from miles_core.train.backend import BACKENDS

    cfg = RunConfig().train
    trainer = BACKENDS.get(cfg.backend)(
        model_dir=model_dir,
        optim=cfg.model_dump(),
        loss=cfg.model_dump(),
        total_steps=1,
        device="cpu",
    )
    transport = TRANSPORTS.get("p2p")()
    transport.connect([server])
    version = [1000]

    def push() -> None:
        version[0] += 1
        transport.push(trainer, version[0], pause_mode="retract")

    gbps = nbytes / _median(push, reps) / 1e9
    expected = [x for b in trainer.named_weights(64 << 20) for x in b]
    assert server.weights_checksum() == weights_checksum(expected)
    raw = nbytes / raw_send_s(transport, trainer, reps) / 1e9
    transport.close()
    trainer.close()
    return gbps, raw


def _median(fn, reps: int) -> float:
    fn()  # warm-up: first-touch page faults, server imports
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {p: bench(p, args.reps) for p in args.presets.split(",")}
    cols = ("memcpy", *COMPARED, *RAW.values(), "flatten")
    print(f"{'preset':8}{'MB':>8}" + "".join(f"{c + ' GB/s':>20}" for c in cols))
    for p, r in results.items():
        print(f"{p:8}{r['bytes'] / 1e6:>8.1f}" + "".join(f"{r[c]:>20.2f}" for c in cols))
    print(f"{'preset':8}{'':>8}" + "".join(f"{c + ' / memcpy':>20}" for c in COMPARED))
    for p, r in results.items():
        print(f"{p:8}{'':>8}" + "".join(f"{r[c] / r['memcpy']:>20.3f}" for c in COMPARED))
    print(f"{'preset':8}{'':>8}" + "".join(f"{c + ' / raw':>20}" for c in RAW) + "   bound")
    for p, r in results.items():
        bound = 1 / (1 + r["broadcast_raw"] / r["flatten"])
        print(
            f"{p:8}{'':>8}"
            + "".join(f"{r[c] / r[raw]:>20.3f}" for c, raw in RAW.items())
            + f"   {bound:.3f} (broadcast raw + one flatten copy)"
        )
    print(
        "disk delta bytes / full push after one AdamW step at lr 1e-5, bf16 pushes "
        "(weight_sync.dtype=bfloat16): "
        + ", ".join(f"{p} {r['delta_bytes_fraction']:.3f}" for p, r in results.items())
        + "; fp32 pushes: "
        + ", ".join(f"{p} {r['delta_bytes_fraction_fp32']:.3f}" for p, r in results.items())
        + "; bf16 at the 10th step: "
        + ", ".join(f"{p} {r['delta_bytes_fraction_step10']:.3f}" for p, r in results.items())
    )
    for v in LORA_TARGETS:
        print(
            f"LoRA rank 8 on {v}: adapter bytes per push / full push: "
            + ", ".join(
                f"{p} {r[f'lora_{v}_bytes'] / 1e6:.2f} MB / {r['bytes'] / 1e6:.1f} MB = "
                f"{r[f'lora_{v}_fraction']:.4f}"
                for p, r in results.items()
            )
        )
    result = {
        # a LoRA run's push: the adapter alone (rank 8), bitwise on the engine
        "lora": {
            p: {
                v: {
                    "bytes": int(r[f"lora_{v}_bytes"]),
                    "fraction_of_full": round(r[f"lora_{v}_fraction"], 4),
                    "push_ms": {
                        t: round(r[f"lora_{v}_{t}_s"] * 1e3, 2)
                        for t in ("colocated", "shared_memory")
                    },
                }
                for v in LORA_TARGETS
            }
            for p, r in results.items()
        },
        "delta_bytes_fraction": {
            p: round(r["delta_bytes_fraction"], 3) for p, r in results.items()
        },
        "delta_bytes_fraction_fp32": {
            p: round(r["delta_bytes_fraction_fp32"], 3) for p, r in results.items()
        },
        "delta_bytes_fraction_step10": {
            p: round(r["delta_bytes_fraction_step10"], 3) for p, r in results.items()
        },
        "fraction_of_memcpy": {
            p: {c: round(r[c] / r["memcpy"], 3) for c in COMPARED} for p, r in results.items()
        },
        "fraction_of_raw": {
            p: {c: round(r[c] / r[raw], 3) for c, raw in RAW.items()} for p, r in results.items()
        },
        # the most a push that flattens its buckets once can reach of the raw wire: the wire's
        # time plus one flatten copy's (each measured alone, same bytes, same run)
        "flatten_bound_of_raw": {
            p: {c: round(1 / (1 + r[raw] / r["flatten"]), 3) for c, raw in RAW.items()}
            for p, r in results.items()
        },
        # the most shared memory can reach of memcpy: it writes the bytes once (one memcpy) and
        # makes one HTTP round trip, each measured alone in the same run
        "shared_memory_bound": {
            p: round(1 / (1 + r["round_trip_s"] * r["memcpy"] * 1e9 / r["bytes"]), 3)
            for p, r in results.items()
        },
        "round_trip_ms": {p: round(r["round_trip_s"] * 1e3, 3) for p, r in results.items()},
        "gbps": {p: {c: round(r[c], 3) for c in cols} for p, r in results.items()},
        "bytes": {p: int(r["bytes"]) for p, r in results.items()},
        "targets": {
            "shared_memory": 0.5,
            "broadcast": 0.25,
            "fraction_of_raw": 0.8,
            "delta_bytes_fraction": 0.1,
            "lora_fraction_of_full": 0.02,
        },
    }
    print(json.dumps(result))
    from record import record_result  # benchmarks/record.py: results/<name>.json + docs

    record_result("weight_sync", result)


if __name__ == "__main__":
    main()
