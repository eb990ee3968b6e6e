"""Per-GPU memory estimates of a trainer rank and an engine GPU (GB = 10^9 bytes).

The trainer is Megatron-style mixed precision on GPUs: bf16 weights (2 bytes per parameter),
fp32 gradients (4), and AdamW's fp32 main weights and two moments (12) sharded over the
data-parallel ranks (the distributed optimizer: dense weights over dp × cp, experts over the
expert-data-parallel ranks). With `train.offload.optimizer` those 12 bytes leave the GPU but for
one bucket. Activations assume full recomputation with sequence parallelism and flash attention:
each layer keeps its input (2 bytes per hidden value) for every micro-batch in flight (1F1B: pp
on the first stage), plus the working set of the layer being recomputed (34 bytes per hidden
value per token, Korthikanti et al. 2022, without the attention-score term), the tokens a MoE
layer dispatches to its experts, and on the last stage the fp32 logits and their gradient.

An engine GPU holds its share of the weights at the rollout precision and gives the rest of its
memory share to the KV cache: per token and layer, a multi-head latent attention model keeps its
compressed latent (kv_lora_rank + qk_rope_head_dim values, whole on every tensor-parallel GPU),
other models their key and value heads (split over tensor-parallel GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_core.plan.sizes import ModelSizes
from miles_core.train.backends.megatron.layout import Layout

GB = 1e9
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12


@dataclass
class TrainerMemory:
    stage: int  # the pipeline stage of the GPU this estimate is for (the fullest one)
    params: float  # parameters on the GPU
    weights: float  # bytes, as the rest
    grads: float
    optimizer: float
    optimizer_offloaded: float  # what stays on the GPU with train.offload.optimizer
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def total_offloaded(self) -> float:
        return self.weights + self.grads + self.optimizer_offloaded + self.activations


@dataclass
class EngineMemory:
    weights: float  # bytes per GPU
    kv_bytes_per_token: float  # per GPU
    kv_budget: float  # bytes per GPU left for the KV cache

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_budget // self.kv_bytes_per_token))


def _stage_ranges(layout: Layout, layers: int) -> list[range]:
    out, start = [], 0
    for n in layout.stage_layers(layers):
        out.append(range(start, start + n))
        start += n
    return out


def trainer_memory(
    sizes: ModelSizes,
    hf: dict[str, Any],
    layout: Layout,
    seq_len: int,
    micro_batch: int,
    bucket_mb: float,
) -> TrainerMemory:
    """The estimate for the pipeline stage whose GPUs need the most."""
    h = int(hf["hidden_size"])
    vocab = int(hf["vocab_size"])
    topk = sizes.experts_per_token
    expert_width = int(hf.get("moe_intermediate_size") or 0)
    tokens = micro_batch * seq_len / layout.cp  # one micro-batch on one context-parallel rank
    best: TrainerMemory | None = None
    ranges = _stage_ranges(layout, len(sizes.layers))
    for stage, layers in enumerate(ranges):
        dense = sum(sizes.layers[i].dense for i in layers) / layout.tp
        experts = sum(sizes.layers[i].experts for i in layers) / (layout.ep * layout.etp)
        replicated = sum(sizes.layers[i].replicated for i in layers)
        if stage == 0:
            dense += sizes.embedding / layout.tp
        if stage == len(ranges) - 1:
            dense += sizes.head / layout.tp
        params = dense + experts + replicated
        optimizer = OPTIMIZER_BYTES * (
            (dense + replicated) / (layout.dp * layout.cp) + experts / layout.edp
        )
        in_flight = layout.pp - stage  # micro-batches whose layer inputs a 1F1B stage keeps
        kept = len(layers) * in_flight * tokens * h * 2 / layout.tp
        working = 34 * tokens * h / layout.tp
        if any(sizes.layers[i].experts for i in layers):
            # dispatched tokens in and out (bf16) and the expert MLP's gate, up and product
            working += tokens * topk * (2 * h + 3 * expert_width) * 2 / layout.etp
        if stage == len(ranges) - 1:
            working += tokens * vocab / layout.tp * 4 * 2  # fp32 logits and their gradient
        m = TrainerMemory(
            stage=stage,
            params=params,
            weights=WEIGHT_BYTES * params,
            grads=GRAD_BYTES * params,
            optimizer=optimizer,
            optimizer_offloaded=min(optimizer, 3 * bucket_mb * 2**20),
            activations=kept + working,
        )
        if best is None or m.total > best.total:
            best = m
    assert best is not None
    return best


def engine_memory(
    sizes: ModelSizes,
    hf: dict[str, Any],
    tp: int,
    weight_bytes: float,
    gpu_bytes: float,
    share: float,
) -> EngineMemory:
    """One GPU of an engine spanning `tp` GPUs, `weight_bytes` per weight (the rollout
    precision's), `share` of `gpu_bytes` for weights and KV cache."""
    layers = int(hf["num_hidden_layers"])
    weights = sizes.total * weight_bytes / tp
    if hf.get("kv_lora_rank"):  # multi-head latent attention: the latent, whole on each GPU
        per_token = layers * (int(hf["kv_lora_rank"]) + int(hf.get("qk_rope_head_dim") or 0)) * 2
        if hf.get("index_head_dim"):  # a sparse-attention indexer's fp8 keys
            per_token += layers * int(hf["index_head_dim"])
    else:
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        per_token = layers * 2 * max(1, kv // tp) * head_dim * 2
    return EngineMemory(weights, per_token, share * gpu_bytes - weights)
