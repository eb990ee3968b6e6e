"""Qwen3-MoE: Qwen3's decoder with every layer's MLP a mixture of experts, chosen by softmax
top-k with the top-k renormalised. Its forward parts are Qwen3's (`models/qwen3/`: the runner
runs this family's own HF router and experts; the Megatron names cover its experts)."""

from __future__ import annotations

from miles_core.models.family import MODEL_FAMILIES
from miles_core.models.qwen3 import Qwen3


@MODEL_FAMILIES.register("qwen3_moe")
class Qwen3Moe(Qwen3):
    hf_class = "Qwen3MoeForCausalLM"
    fast_forward = None  # the embedded engine runs HF's modules (the serving engine: the runner)

    def hf_config(self, preset, common):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            head_dim=preset.head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_experts=preset.num_experts,
            num_experts_per_tok=preset.top_k,
            moe_intermediate_size=preset.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.0,  # RL trains no load-balancing loss
        )

    @staticmethod
    def route_weights(router, logits, idx):
        """Softmax over the experts, the chosen ones' weights renormalised if asked."""
        import torch

        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
        if getattr(router, "norm_topk_prob", False):
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)

    @staticmethod
    def invariant_route(router, logits, chosen=None):
        """The experts a row chooses (or is given: `chosen`) and their weights, from the
        invariant kernels: softmax over the experts, the top-k, renormalised if asked."""
        from miles_core.true_on_policy import ops

        probs = ops.softmax(logits)
        if chosen is None:
            top, chosen = probs.topk(router.top_k, dim=-1)
        else:
            top = probs.gather(1, chosen)
        if getattr(router, "norm_topk_prob", False):
            top = top / top.sum(dim=-1, keepdim=True)
        return chosen, top

    def megatron_router(self, hf):
        # without norm_topk_prob: the softmax over all experts (Megatron's pre-softmax)
        return dict(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        )
