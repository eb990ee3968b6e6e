"""Run under torchrun: rank 0 drives a trainer for a few steps on a fixed batch, once per config
(one launch for all of them; the follower ranks replay every trainer rank 0 builds), and writes
the final weights and metrics of config i to `<out>-<i>.safetensors` / `.json`.

A config holds train settings and optionally `model` (another HF directory than the launch's,
e.g. an MoE model), `backend` (default fsdp), `parallel` (Megatron's layout), `steps` (default 2), `rows` and `leaves` (the batch's shape), `load` (a checkpoint to
resume from, with `old_from`: the JSON of the run whose old log-probs it continues), `save`
(a directory: the trainer's checkpoint after the steps) and `push` (true: after the weights are
written, the trainer pushes through every transport in turn, a step between two pushes, and the
JSON gets {transport: engine checksum == trainer's} under "pushes", `push_through_transports`)
and `push_quantized` (a rollout.precision spec: one p2p push of the quantized weights, each rank
quantizing its own rows, to an engine server holding that format; "quantized_p2p" in the JSON
says whether its checksum is the plan's export of the trainer's weights). `lora` (train.lora's
settings) trains adapters; their pushes carry them alone."""

import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import miles_core  # noqa: F401
from miles_core.config import ParallelConfig, RunConfig
from miles_core.config.lora import LoraSettings
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.lora.adapter import engine_spec
from miles_core.models import load_hf_dir
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.train import distributed
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch
from miles_core.train.losses.policy import PolicyOptions
from miles_core.weights import TRANSPORTS, weights_checksum
from miles_core.weights.transports.disk import DiskTransport


def push_through_transports(
    trainer, model_dir: str, batch: TrainBatch, lora: LoraSettings | None = None
) -> dict[str, bool]:
    """Pushes the trainer's weights through every transport in turn, a train step before each
    (so each push carries new weights): colocated (into an engine in this process), shared
    memory, disk, broadcast (gathered on rank 0) and p2p (each holding rank sends its own shards;
    fp32, then bf16) to an engine server subprocess. After each push the engine's checksum is
    compared with the trainer's weights in the push dtype, as `weight_sync.check_equal` does.
    With `lora` (train.lora), the engines serve the adapters and the pushes carry them alone."""
    model, tok = load_hf_dir(model_dir)
    tmp = Path(tempfile.mkdtemp())
    spec = engine_spec(lora, model) if lora else None
    args = ["--threads", "1", *(["--lora", json.dumps(spec)] if spec else [])]
    server = EngineProcess(model_dir, args=args, log_path=tmp / "engine.log", weight_roots=[tmp])
    server.start()
    client = HttpEngine(server.url)
    results: dict[str, bool] = {}
    try:
        for name, dtype in COMPARED:
            trainer.train_step(batch)
            if name == "disk":
                transport = DiskTransport(root=str(tmp / "w"), keep=1)
            else:
                transport = TRANSPORTS.get(name)(**({"dtype": dtype} if dtype else {}))
            engine = (
                EmbeddedEngine(model, tok, seed=0, lora=spec) if name == "colocated" else client
            )
            transport.connect([engine])
            transport.push(trainer, version=len(results) + 1, pause_mode="retract")
            expected = [
                (n, t.to(dtype).to(t.dtype) if dtype is not None else t)
                for b in trainer.named_weights()
                for n, t in b
            ]
            key = name if dtype is None else f"{name}_bf16"
            scope = "adapters" if spec else "all"
            results[key] = engine.weights_checksum(scope) == weights_checksum(expected)
            transport.close()
    finally:
        client.close()
        server.stop()
    return results


def push_quantized_p2p(trainer, model_dir: str, spec: dict) -> bool:
    from miles_core.precision.plan import QuantPlan
    from miles_core.precision.push import QuantizedSource

    tmp = Path(tempfile.mkdtemp())
    args = ["--threads", "1", "--precision", json.dumps(spec)]
    server = EngineProcess(model_dir, args=args, log_path=tmp / "engine.log")
    server.start()
    client = HttpEngine(server.url)
    try:
        layers = int(load_hf_dir(model_dir)[0].config.num_hidden_layers)
        plan = QuantPlan.from_spec(spec, layers)
        transport = TRANSPORTS.get("p2p")()
        transport.connect([client])
        transport.push(QuantizedSource(trainer, plan), version=1, pause_mode="retract")
        expected = plan.export(n_t for b in trainer.named_weights() for n_t in b)
        same = client.weights_checksum() == weights_checksum(expected.items())
        transport.close()
        return same
    finally:
        client.close()
        server.stop()


COMPARED = [
    ("colocated", None),
    ("shared_memory", None),
    ("disk", None),
    ("broadcast", None),
    ("p2p", None),
    ("p2p", torch.bfloat16),
]
model_dir, out_prefix = sys.argv[1], sys.argv[2]
configs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else [{}]
rank, world = distributed.init_distributed()
if rank > 0:
    distributed.follow()
    sys.exit(0)

model, tok = load_hf_dir(model_dir)
rng = random.Random(0)
reqs = [
    GenerateRequest(
        input_ids=encode_prompt(tok, rng.choice(["say a", "reverse abcdef", "12+34="])),
        sampling_params=SamplingParams(
            max_new_tokens=rng.randint(3, 12), stop_token_ids=[tok.eos_token_id]
        ),
    )
    for _ in range(16)
]
out = EmbeddedEngine(model, tok, seed=0).generate(reqs)
advantages = [rng.gauss(0, 1) for _ in out]
for i, loss_overrides in enumerate(configs):
    loss_overrides = dict(loss_overrides)
    rows = loss_overrides.pop("rows", len(out))  # the batch's first `rows` samples
    leaves = loss_overrides.pop("leaves", 1)  # consecutive rows sharing a rollout id
    backend = loss_overrides.pop("backend", "fsdp")
    model_i = loss_overrides.pop("model", model_dir)
    num_steps = loss_overrides.pop("steps", 2)
    load, save, old_from, push, push_quantized = (
        loss_overrides.pop(k, None) for k in ("load", "save", "old_from", "push", "push_quantized")
    )
    parallel = ParallelConfig(**loss_overrides.pop("parallel", {}))
    if "lora" in loss_overrides:  # train.lora, its defaults filled in
        loss_overrides["lora"] = LoraSettings(**loss_overrides["lora"])
    loss = PolicyOptions(
        **{k: loss_overrides.pop(k) for k in PolicyOptions.model_fields if k in loss_overrides}
    )
    batch = TrainBatch(
        tokens=[q.input_ids + r.output_ids for q, r in zip(reqs, out, strict=True)],
        response_lengths=[len(r.output_ids) for r in out],
        loss_masks=[[1] * len(r.output_ids) for r in out],
        advantages=list(advantages),
        rollout_log_probs=[r.output_log_probs for r in out],
        sample_ids=[f"r{j // leaves}" for j in range(len(out))],
    ).slice(0, rows)
    cfg = RunConfig().train.model_copy(
        update={
            "micro_batch_size": 4,
            "world_size": world,
            "lr": 1e-2,
            "parallel": parallel,
            "loss_options": loss,
            **loss_overrides,
        }
    )
    trainer = BACKENDS.get(backend)(
        model_dir=model_i, optim=cfg.model_dump(), loss=cfg.model_dump(), total_steps=10
    )
    if load:
        trainer.load(load)
    if old_from:
        with open(old_from) as f:
            batch.old_log_probs = json.load(f)["old_log_probs"]
    else:
        batch.old_log_probs = trainer.compute_log_probs(batch)
    metrics = [trainer.train_step(batch) for _ in range(num_steps)]
    if save:
        trainer.save(save)
    weights = {n: t.clone() for b in trainer.named_weights() for n, t in b}
    pushes = push_through_transports(trainer, model_i, batch, cfg.lora) if push else None
    quantized = push_quantized_p2p(trainer, model_i, push_quantized) if push_quantized else None
    trainer.close()
    save_file(weights, f"{out_prefix}-{i}.safetensors")
    with open(f"{out_prefix}-{i}.json", "w") as f:
        result = {"metrics": metrics, "old_log_probs": batch.old_log_probs, "pushes": pushes}
        json.dump(result | {"quantized_p2p": quantized}, f)
distributed.shutdown()
