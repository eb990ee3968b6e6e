"""The Megatron `GPTModel` of an HF (Qwen3) config, for this rank's pipeline stage: RMSNorm, gated
SiLU MLP, RoPE, q/k RMSNorm, grouped-query attention, no biases, tied or untied embeddings,
built from megatron-core's own modules (the local layer spec: no TransformerEngine)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_core.train.megatron.architecture import rope_theta
from miles_core.train.megatron.convert import Shapes


def transformer_config(hf: dict[str, Any], layout, params_dtype: torch.dtype, bf16: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = Shapes.of(hf)
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        ffn_hidden_size=s.ffn,
        num_attention_heads=s.heads,
        num_query_groups=s.groups,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        use_cpu_initialization=True,
        perform_initialization=False,  # the weights come from the HF directory
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        # the step loop divides by the global token count itself; with this, Megatron's
        # gradient buffers are summed over data-parallel ranks, not averaged (backend.py)
        calculate_per_token_loss=True,
    )


def build_gpt(hf: dict[str, Any], layout, params_dtype: torch.dtype = torch.float32, bf16=False):
    """This rank's stage of the model (uninitialised weights: load them, `convert.py`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    s = Shapes.of(hf)
    config = transformer_config(hf, layout, params_dtype, bf16)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(
        config,
        spec,
        vocab_size=s.padded_vocab(layout.tp),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=s.tied,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf)),
    )
