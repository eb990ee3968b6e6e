"""Run under torchrun: rank 0 drives a Megatron trainer (the layout in argv) that takes a step,
then pushes its weights through every transport in turn, a step between two pushes: colocated
(into an engine in rank 0's process), shared memory, disk, broadcast (gathered on rank 0) and
p2p (each holding rank sends its own tensor-parallel shards, fp32 then bf16) to an engine server
subprocess. After each push the engine's checksum is compared with the trainer's weights (in the
push dtype), as `weight_sync.check_equal` does. Writes {transport: equal} as JSON to argv[3]."""

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

import miles_core  # noqa: F401
from miles_core.config import ParallelConfig, RunConfig
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.models import load_hf_dir
from miles_core.rollout.http_engine import EngineProcess, HttpEngine
from miles_core.train import distributed
from miles_core.train.batch import TrainBatch
from miles_core.train.registry import make_backend
from miles_core.weights import make_transport, weights_checksum
from miles_core.weights.disk import DiskTransport


def main() -> None:
    model_dir, parallel, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    rank, world = distributed.init_distributed()
    if rank > 0:
        distributed.follow()
        return
    cfg = RunConfig().train.model_copy(
        update={
            "micro_batch_size": 4,
            "world_size": world,
            "lr": 1e-2,
            "parallel": ParallelConfig(**parallel),
        }
    )
    trainer = make_backend(
        "megatron", model_dir=model_dir, optim=cfg.model_dump(), loss=cfg.model_dump()
    )
    rng = random.Random(0)
    tokens = [[rng.randrange(1, 100) for _ in range(12)] for _ in range(8)]
    batch = TrainBatch(
        tokens=tokens,
        response_lengths=[6] * 8,
        loss_masks=[[1] * 6] * 8,
        advantages=[rng.gauss(0, 1) for _ in range(8)],
        rollout_log_probs=[[-1.0] * 6] * 8,
        sample_ids=[str(i) for i in range(8)],
    )
    batch.old_is_current = True
    model, tok = load_hf_dir(model_dir)
    tmp = Path(tempfile.mkdtemp())
    server = EngineProcess(
        model_dir, args=["--threads", "1"], log_path=tmp / "engine.log", weight_roots=[tmp]
    )
    server.start()
    client = HttpEngine(server.url)
    results = {}
    try:
        for name, dtype in (
            ("colocated", None),
            ("shared_memory", None),
            ("disk", None),
            ("broadcast", None),
            ("p2p", None),
            ("p2p", torch.bfloat16),
        ):
            trainer.train_step(batch)  # new weights for every push
            options = {"dtype": dtype} if dtype is not None else {}
            if name == "disk":
                transport = DiskTransport(root=str(tmp / "w"), keep=1)
            else:
                transport = make_transport(name, **options)
            engine = EmbeddedEngine(model, tok, seed=0) if name == "colocated" else client
            transport.connect([engine])
            transport.push(trainer, version=len(results) + 1, pause_mode="retract")
            expected = [
                (n, t.to(dtype).to(t.dtype) if dtype is not None else t)
                for b in trainer.named_weights()
                for n, t in b
            ]
            key = name if dtype is None else f"{name}_bf16"
            results[key] = engine.weights_checksum() == weights_checksum(expected)
            transport.close()
    finally:
        client.close()
        server.stop()
        trainer.close()
        distributed.shutdown()
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
