"""Which HF architectures the Megatron converter maps and the backend builds: decoder-only Qwen3
(RMSNorm, gated SiLU MLP, RoPE, q/k RMSNorm per head, grouped-query attention, no biases, tied or
untied embeddings) and its mixture-of-experts families: Qwen3-MoE (softmax top-k) and GLM4-MoE
(full rotary, q/k norms, sigmoid top-k with a correction bias, renormalised, shared experts,
leading dense layers). Anything else is refused before the run starts, with what differs. Pure
Python."""

from __future__ import annotations

from typing import Any

MODEL_TYPES = ("qwen3", "qwen3_moe", "glm4_moe")  # what the converter maps and the backend builds


def check_architecture(hf: dict[str, Any], where: str = "the model") -> None:
    """Raises ValueError naming what of the HF config `hf` (a dict) the converter cannot map."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"train.backend megatron: {where} is a {model_type!r} model; the HF ↔ Megatron "
            f"converter knows {', '.join(MODEL_TYPES)} (miles_core/train/backends/megatron/convert.py)"
        )
    bad = []
    rope = hf.get("rope_parameters") or {}
    if model_type == "glm4_moe":
        if not hf.get("use_qk_norm"):
            bad.append("glm4_moe without use_qk_norm")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            bad.append(f"partial_rotary_factor {rope['partial_rotary_factor']}")
        if int(hf.get("n_group") or 1) != 1:
            bad.append(f"group-limited routing (n_group {hf.get('n_group')})")
        if not hf.get("norm_topk_prob", True) and int(hf.get("num_experts_per_tok") or 1) > 1:
            bad.append("sigmoid routing without norm_topk_prob (Megatron renormalises)")
    if hf.get("attention_bias"):
        bad.append("attention_bias: true")
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {hf.get('hidden_act')!r} (silu only)")
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        bad.append(f"rope scaling {rope.get('rope_type') or hf.get('rope_scaling')!r}")
    if hf.get("use_sliding_window"):
        bad.append("sliding-window attention")
    if rope_theta(hf) != int(rope_theta(hf)):
        bad.append(f"rope_theta {rope_theta(hf)} (Megatron's rotary base is an integer)")
    if bad:
        raise ValueError(
            f"train.backend megatron: {where} uses {', '.join(bad)}, which the Megatron "
            "backend does not build"
        )


def rope_theta(hf: dict[str, Any]) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
