"""The text `miles plan` prints: the model, the trainer's layout and memory per GPU, the engines'
and the placement node by node."""

from __future__ import annotations

import re

from miles_core.plan.memory import GB
from miles_core.plan.plan import Plan

_TRAIN = re.compile(r"^train rank (\d+)$")
_ENGINE = re.compile(r"^engine (\d+) \(tp rank (\d+)\)$")


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def _node_lines(plan: Plan) -> list[str]:
    lines = []
    nodes = sorted({b.node for b in plan.placement.bundles})
    for node in nodes:
        bundles = [b for b in plan.placement.bundles if b.node == node]
        ranks: list[int] = []
        engines: dict[int, list[int]] = {}
        for b in bundles:
            for role in b.roles:
                if m := _TRAIN.match(role):
                    ranks.append(int(m.group(1)))
                elif m := _ENGINE.match(role):
                    engines.setdefault(int(m.group(1)), []).append(int(m.group(2)))
        parts = [f"train ranks {_span(ranks)}"] if ranks else []
        if engines and all(tps == [0] for tps in engines.values()):  # one GPU each
            parts.append(f"engines {_span(sorted(engines))}, one GPU each")
        else:
            parts += [f"engine {e} (tp ranks {_span(tps)})" for e, tps in engines.items()]
        idle = [b.index for b in bundles if not b.roles]
        if idle:
            parts.append(f"idle bundles {_span(idle)}")
        lines.append(
            f"  node {node}, bundles {_span([b.index for b in bundles])}: " + "; ".join(parts)
        )
    return lines


def render(plan: Plan, config) -> str:
    hf, s, t, layout = plan.hf, plan.sizes, plan.trainer, plan.layout
    cluster = config.cluster
    nodes = -(-plan.gpus // cluster.gpus_per_node)
    side = "colocated" if cluster.colocate else "disaggregated"
    moe = (
        f", {s.experts_per_layer} experts ({s.experts_per_token} per token)"
        if s.experts_per_layer
        else ""
    )
    stages = "/".join(str(n) for n in layout.stage_layers(len(s.layers)))
    lines = [
        f"{plan.gpus} GPUs ({nodes} node(s) of {cluster.gpus_per_node}, "
        f"{cluster.gpu_memory_gb:g} GB each), {side}",
        f"model    {plan.model} ({hf.get('model_type')}): {s.total / 1e9:,.2f}B parameters, "
        f"{s.active / 1e9:,.2f}B active per token; {len(s.layers)} layers{moe}",
        f"trainer  {config.train.world_size} GPUs: {layout.describe()}"
        + (f", expert-dp {layout.edp}" if s.experts_per_layer else "")
        + f", layers per stage {stages}; "
        f"micro-batch {config.train.micro_batch_size} × {plan.seq_len:,} tokens",
        f"  per GPU (stage {t.stage}, the fullest): {t.params / 1e9:,.2f}B parameters",
        f"    weights, bf16                {_gb(t.weights):>12}",
        f"    gradients, fp32              {_gb(t.grads):>12}",
        f"    optimizer, fp32 main + Adam  {_gb(t.optimizer):>12}   "
        f"offloaded: {_gb(t.optimizer_offloaded)} on the GPU",
        f"    activations (recomputed)     {_gb(t.activations):>12}",
        f"    total                        {_gb(t.total):>12}   "
        f"with the optimizer offloaded: {_gb(t.total_offloaded)}",
        f"    train.offload.optimizer: {plan.offload}",
    ]
    e = plan.engine
    if e is not None:
        p = plan.placement
        lines += [
            f"rollout  {p.engines} engine(s) × {p.gpus_per_engine} GPU(s) "
            f"({config.rollout.engine}), precision {config.rollout.precision}",
            f"  per GPU: weights {_gb(e.weights)}, KV cache {_gb(e.kv_budget)} = "
            f"{e.kv_tokens:,} tokens ({e.kv_bytes_per_token / 1e3:,.1f} kB each): "
            f"{e.kv_tokens // plan.seq_len:,} sequences of {plan.seq_len:,} at once",
        ]
    lines.append("placement (one {GPU: 1, CPU: 1} bundle per GPU)")
    lines += _node_lines(plan)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
