"""One FSDP2 step on CUDA (bf16 compute, fp32 params): writes what the GPU test checks."""

import json
import random
import sys

import torch

import miles_core  # noqa: F401
from miles_core.config import RunConfig
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import load_hf_dir
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch

model_dir, out = sys.argv[1], sys.argv[2]
model, tok = load_hf_dir(model_dir)
rng = random.Random(0)
reqs = [
    GenerateRequest(
        input_ids=encode_prompt(tok, rng.choice(["say a", "reverse abcdef", "12+34="])),
        sampling_params=SamplingParams(max_new_tokens=8, stop_token_ids=[tok.eos_token_id]),
    )
    for _ in range(8)
]
res = EmbeddedEngine(model, tok, seed=0).generate(reqs)
batch = TrainBatch(
    tokens=[q.input_ids + r.output_ids for q, r in zip(reqs, res, strict=True)],
    response_lengths=[len(r.output_ids) for r in res],
    loss_masks=[[1] * len(r.output_ids) for r in res],
    advantages=[rng.gauss(0, 1) for _ in res],
    rollout_log_probs=[r.output_log_probs for r in res],
)
cfg = RunConfig().train.model_copy(update={"micro_batch_size": 4}).model_dump()
trainer = BACKENDS.get("fsdp")(
    model_dir=model_dir, optim=cfg, loss=cfg, total_steps=2, device="cuda"
)
before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
batch.old_log_probs = trainer.compute_log_probs(batch)
diff = max(
    abs(a - b)
    for r, o in zip(batch.old_log_probs, batch.rollout_log_probs, strict=True)
    for a, b in zip(r, o, strict=True)
)
seen: dict[str, str] = {}


def note_dtype(module, inputs, output) -> None:  # returns None: the output stays as it is
    out = output[0] if isinstance(output, tuple) else output
    seen.setdefault("dtype", str(out.dtype))


hook = trainer.model.model.layers[0].register_forward_hook(note_dtype)
metrics = trainer.train_step(batch)
hook.remove()
param = next(trainer.model.parameters())
moved = any(
    not torch.equal(before[n], p.full_tensor()) for n, p in trainer.model.named_parameters()
)
json.dump(
    {
        "device": str(param.device),
        "param_dtype": str(param.dtype),
        "compute_dtype": seen.get("dtype"),
        "max_logprob_diff_vs_cpu": diff,
        "ppo_kl": metrics["ppo_kl"],
        "grad_norm": metrics["grad_norm"],
        "weights_moved": moved,
    },
    open(out, "w"),
)
trainer.close()
