"""GLM4-MoE (DeepSeek-V3 style): leading dense layers, then MoE layers whose experts are chosen
by sigmoid score plus a correction bias (which chooses, never weighs), renormalised and scaled,
beside shared experts every token goes through; attention as Qwen3's (q/k RMSNorm, full RoPE,
no bias). Its forward parts are Qwen3's (`models/qwen3/`) with the checks and names below. GLM's
own chat format has no TITO family here (a preset's tokenizer renders with `tiny`)."""

from __future__ import annotations

from miles_core.models.family import MODEL_FAMILIES
from miles_core.models.qwen3 import Qwen3


@MODEL_FAMILIES.register("glm4_moe")
class Glm4Moe(Qwen3):
    hf_class = "Glm4MoeForCausalLM"
    chat_template = ""
    fast_forward = None  # the embedded engine runs HF's modules (the serving engine: the runner)

    def hf_config(self, preset, common):
        from transformers import Glm4MoeConfig

        if preset.hidden_size != preset.num_attention_heads * preset.head_dim:
            raise ValueError("glm4_moe presets: head_dim must be hidden_size / num_attention_heads")
        return Glm4MoeConfig(
            **common,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
            },
            use_qk_norm=True,
            n_routed_experts=preset.num_experts,
            num_experts_per_tok=preset.top_k,
            moe_intermediate_size=preset.moe_intermediate_size,
            n_shared_experts=preset.shared_experts,
            first_k_dense_replace=preset.dense_layers,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            num_nextn_predict_layers=0,  # no multi-token-prediction layers
        )

    def init_extra(self, model, seed):
        """The routing correction bias, which a random init leaves at zero: drawn small and
        seeded, so the bias path is exercised from the first step."""
        import torch

        gen = torch.Generator().manual_seed(seed + 1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)

    def runner_refuses(self, config):
        if not getattr(config, "use_qk_norm", False):
            return "glm4_moe without use_qk_norm (the runner's attention normalises q and k)"
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return (
                f"partial_rotary_factor {rope['partial_rotary_factor']} (the runner "
                "rotates every dimension)"
            )
        return super().runner_refuses(config)

    @staticmethod
    def route_weights(router, logits, idx):
        """Sigmoid scores of the chosen experts (the correction bias only chooses, never
        weighs), renormalised if asked, times the routed scaling factor."""
        w = logits.float().sigmoid().gather(1, idx)
        if getattr(router, "norm_topk_prob", False):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor

    def invariant_refuses(self, config):
        if int(getattr(config, "n_group", None) or 1) != 1:
            return f"group-limited routing (n_group {config.n_group})"
        return super().invariant_refuses(config)

    @staticmethod
    def invariant_route(router, logits, chosen=None):
        """Sigmoid scores from the invariant kernels; the top-k of score plus correction bias
        (or the experts given: `chosen`), weighed by their scores, renormalised if asked, times
        the routed scaling factor."""
        from miles_core.true_on_policy import ops

        scores = ops.sigmoid(logits)
        if chosen is None:
            chosen = (scores + router.e_score_correction_bias).topk(router.top_k, dim=-1)[1]
        w = scores.gather(1, chosen)
        if getattr(router, "norm_topk_prob", False):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, w * router.routed_scaling_factor

    def megatron_refuses(self, hf):
        bad = []
        rope = hf.get("rope_parameters") or {}
        if not hf.get("use_qk_norm"):
            bad.append("glm4_moe without use_qk_norm")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            bad.append(f"partial_rotary_factor {rope['partial_rotary_factor']}")
        if int(hf.get("n_group") or 1) != 1:
            bad.append(f"group-limited routing (n_group {hf.get('n_group')})")
        if not hf.get("norm_topk_prob", True) and int(hf.get("num_experts_per_tok") or 1) > 1:
            bad.append("sigmoid routing without norm_topk_prob (Megatron renormalises)")
        return bad + super().megatron_refuses(hf)

    def megatron_names(self):
        from dataclasses import replace

        names = super().megatron_names()
        router = "mlp.gate.weight"
        bias = {"mlp.gate.e_score_correction_bias": "mlp.router.expert_bias"}
        return replace(names, moe={router: names.moe[router], **bias, **names.moe})

    def megatron_router(self, hf):
        # HF's correction bias is a fixed buffer: Megatron must not update it from load stats
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        )
