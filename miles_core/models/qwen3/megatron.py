"""The Qwen3 decoder in Megatron's `GPTModel` terms: which HF tensor each Megatron tensor holds
(`NAMES`, read by the converter `train/backends/megatron/convert.py`). Its MoE names are
Qwen3-MoE's; GLM4-MoE adds its router's correction bias (`glm4_moe/`)."""

from __future__ import annotations

from miles_core.train.backends.megatron.convert import HFNames

NAMES = HFNames(
    layer={
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    },
    qkv=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    fc1=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    top={
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight",
    },
    # an MoE layer's MLP: the router, the shared experts (one fused MLP), and each routed
    # expert e, a slice [e] of HF's fused 3-D expert tensors
    moe={
        "mlp.gate.weight": "mlp.router.weight",
        "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    },
    shared_fc1=("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    experts={
        "mlp.experts.gate_up_proj": "linear_fc1.weight",
        "mlp.experts.down_proj": "linear_fc2.weight",
    },
)
