"""The Megatron `GPTModel` of an HF config, for this rank's pipeline stage: the decoder of the
model families with a Megatron conversion (RMSNorm, gated SiLU MLP, RoPE, q/k RMSNorm,
grouped-query attention, no biases, tied or untied embeddings), built from megatron-core's own
modules (the local layer spec: no TransformerEngine).

Mixture-of-experts families get MoE layers where HF has them (`moe_layer_freq`), routed as HF
routes: the family's `megatron_router` settings (softmax or sigmoid scores, a correction bias,
renormalisation, a scaling factor). No load-balancing loss, no token dropping, the allgather
dispatcher (the one that runs on gloo), experts split over `ep` data-parallel ranks, never over
tensor-parallel ones, and Megatron's router-replay hook on the policy's routers
(`routing_replay.py`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_core.train.backends.megatron.architecture import check_architecture, rope_theta
from miles_core.train.backends.megatron.convert import Shapes


def moe_settings(hf: dict[str, Any], layout, replay_hook: bool) -> dict[str, Any]:
    """The TransformerConfig fields of an MoE config ({} for a dense one)."""
    s = Shapes.of(hf)
    if not s.experts:
        return {}
    out: dict[str, Any] = dict(
        num_moe_experts=s.experts,
        moe_router_topk=s.top_k,
        moe_ffn_hidden_size=s.expert_ffn,
        moe_layer_freq=[int(i in s.moe_layers) for i in range(s.layers)],
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",  # HF's routers compute their logits in fp32
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        moe_enable_routing_replay=replay_hook,
    )
    out.update(check_architecture(hf).megatron_router(hf))  # the family's routing rule
    if s.shared_experts:
        out["moe_shared_expert_intermediate_size"] = s.shared_experts * s.expert_ffn
    return out


def transformer_config(
    hf: dict[str, Any], layout, params_dtype: torch.dtype, bf16: bool, replay_hook: bool = False
):
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
        **moe_settings(hf, layout, replay_hook),
    )


def build_gpt(
    hf: dict[str, Any],
    layout,
    params_dtype: torch.dtype = torch.float32,
    bf16=False,
    replay_hook: bool = False,
):
    """This rank's stage of the model (uninitialised weights: load them, `convert.py`).
    `replay_hook`: its routers carry Megatron's `RouterReplay` (the policy under routing
    replay or its checker; never a reference model, which routes by itself)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.moe.router_replay import RouterReplay

    s = Shapes.of(hf)
    config = transformer_config(hf, layout, params_dtype, bf16, replay_hook)
    if s.experts:  # a spec per layer (dense or MoE: moe_layer_freq), this stage's slice
        # Megatron keeps every router's replay instance in a process-wide list, never emptied;
        # ours are found on the model (routing_replay.py), so the list is cleared, not grown
        RouterReplay.clear_global_router_replay_instances()
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
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
