"""Optimizer-state offload: peak memory and step time of the FSDP trainer with AdamW's state
resident, in host memory (`cpu`) and in bucket files (`disk`), side by side in one run.

Each mode trains the same model (a Qwen3 of about 94M parameters, built here) for the same SFT
steps in a fresh process, on one thread. Per mode: the process's peak RSS, the optimizer state the process
holds between steps, the median step time, and a checksum of the weights after the last step
(the same in every mode: the offloaded optimizer is bitwise the resident one).

    python benchmarks/optimizer_offload.py             # ≈ 2 minutes

Prints a table, then one JSON object as the last line (recorded in
benchmarks/results/optimizer_offload.json and docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "cpu", "disk")
STEPS = 5
BUCKET_MB = 32


def build_model_dir(directory: Path) -> int:
    """A Qwen3 of about 94M parameters with the tiny preset's tokenizer; its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles_core.models import build_model, save_hf_dir

    _, tok = build_model("tiny", seed=0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    )
    import torch

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    save_hf_dir(model, tok, directory)
    return sum(p.numel() for p in model.parameters())


def child(mode: str, model_dir: str, state_dir: str) -> dict:
    """One mode's trainer and steps, in this (fresh) process."""
    import torch
    from transformers import AutoTokenizer

    from miles_core.config import RunConfig
    from miles_core.rollout.rollout_fn import encode_prompt
    from miles_core.train.backend import BACKENDS
    from miles_core.train.batch import TrainBatch

    offload = {"optimizer": mode, "bucket_mb": BUCKET_MB}
    if mode == "disk":
        offload["dir"] = state_dir
    # one thread: a CPU embedding's backward sums rows in a thread-dependent order, and the
    # weights must be comparable bit for bit across the modes' processes
    update = {"lr": 1e-4, "micro_batch_size": 8, "threads": 1}
    settings = RunConfig().train.model_copy(update=update)
    settings = settings.model_dump() | {"offload": offload}
    trainer = BACKENDS.get("fsdp")(model_dir=model_dir, optim=settings, loss=settings)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = encode_prompt(tok, "say a")
    rows = [tok.encode("a" * n, add_special_tokens=False) + [tok.eos_token_id] for n in range(8)]
    batch = TrainBatch(
        tokens=[prompt + r for r in rows],
        response_lengths=[len(r) for r in rows],
        loss_masks=[[1] * len(r) for r in rows],
    )
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        trainer.train_step(batch, loss="sft")
        times.append(time.perf_counter() - t0)
    opt = trainer.optimizer
    if hasattr(opt, "resident_state_bytes"):
        held = opt.resident_state_bytes()
    else:
        held = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_held_mb": held / 2**20,
        "step_s": statistics.median(times[1:]),  # the first step also builds the state
        "weights_sha256": digest.hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--model-dir")
    ap.add_argument("--state-dir")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.state_dir)))
        return
    with tempfile.TemporaryDirectory(prefix="miles-offload-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model_dir(model_dir)
        modes = {}
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--model-dir", str(model_dir),
                 "--state-dir", str(Path(tmp) / "state")],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            modes[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = modes["none"]
    print("| optimizer state | peak RSS MB | state held MB | step s | weights |")
    print("|---|---|---|---|---|")
    for mode, m in modes.items():
        same = "same" if m["weights_sha256"] == base["weights_sha256"] else "DIFFERENT"
        print(
            f"| {mode} | {m['peak_rss_mb']:.0f} | {m['state_held_mb']:.0f} "
            f"| {m['step_s']:.2f} | {same} |"
        )
    result = {
        "params": params,
        "steps": STEPS,
        "bucket_mb": BUCKET_MB,
        "modes": modes,
        "bitwise_same": len({m["weights_sha256"] for m in modes.values()}) == 1,
        "disk_peak_rss_ratio": modes["disk"]["peak_rss_mb"] / base["peak_rss_mb"],
        "disk_step_time_ratio": modes["disk"]["step_s"] / base["step_s"],
    }
    print(json.dumps(result))
    sys.path.insert(0, str(Path(__file__).parent))
    from record import record_result

    record_result("optimizer_offload", result)


if __name__ == "__main__":
    main()
