"""Which HF architecture a preset builds: one config builder per family, registered by name.

    qwen3      Qwen3ForCausalLM (dense)
    qwen3_moe  Qwen3MoeForCausalLM: every layer MoE, softmax top-k routing, top-k renormalised
    glm4_moe   Glm4MoeForCausalLM: leading dense layers, then sigmoid top-k routing with a score
               correction bias and shared experts (DeepSeek-V3 style); attention as Qwen3's
               (q/k RMSNorm, full RoPE, no bias)

Every family gets the same attention (q/k norms, full rotary, no bias), tied embeddings and the
run's tokenizer ids, so the families differ in their MLPs alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Glm4MoeConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from miles_core.models.presets import ModelPreset


def _common(p: ModelPreset, vocab_size: int, pad: int, eos: int, context: int | None) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=context or p.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=None,
        attention_dropout=0.0,
        dtype="float32",
    )


def _qwen3(p: ModelPreset, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen3Config(**common, head_dim=p.head_dim, rope_theta=10000.0)


def _qwen3_moe(p: ModelPreset, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen3MoeConfig(
        **common,
        head_dim=p.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        moe_intermediate_size=p.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.0,  # RL trains no load-balancing loss
    )


def _glm4_moe(p: ModelPreset, common: dict[str, Any]) -> PretrainedConfig:
    if p.hidden_size != p.num_attention_heads * p.head_dim:
        raise ValueError("glm4_moe presets: head_dim must be hidden_size / num_attention_heads")
    return Glm4MoeConfig(
        **common,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        },
        use_qk_norm=True,
        n_routed_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        moe_intermediate_size=p.moe_intermediate_size,
        n_shared_experts=p.shared_experts,
        first_k_dense_replace=p.dense_layers,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        num_nextn_predict_layers=0,  # no multi-token-prediction layers
    )


def init_extra(model: torch.nn.Module, seed: int) -> None:
    """What a random init leaves at zero and a trained model does not: GLM4-MoE's routing
    correction bias (it steers which experts are chosen, never their weights), drawn small and
    seeded, so the bias path is exercised from the first step."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)


FAMILIES: dict[str, Callable[[ModelPreset, dict[str, Any]], PretrainedConfig]] = {
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "glm4_moe": _glm4_moe,
}


def family_config(
    p: ModelPreset, vocab_size: int, pad: int, eos: int, context: int | None
) -> PretrainedConfig:
    if p.family not in FAMILIES:
        raise ValueError(f"unknown model family {p.family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[p.family](p, _common(p, vocab_size, pad, eos, context))
