"""Qwen3 (dense): grouped-query attention with q/k RMSNorm per head, full RoPE, no biases, SiLU
MLPs. The decoder the MoE families here (`qwen3_moe`, `glm4_moe`) share, so its forward parts
serve them too:

- `runner.py`: the serving engine's lean forward over a slot KV cache (`runner_moe.py` runs an
  MoE layer's MLP on the family's own HF router and experts);
- `runner_forward.py`: the embedded engine's `BatchForward` on that runner;
- `invariant.py`: the forward of `train.true_on_policy`, from the invariant kernels;
- `megatron.py`: the HF tensor names of each Megatron tensor (what the backend refuses is
  `megatron_refuses` below).

The checks here are pure Python over the config's fields (they run at config time).
"""

from __future__ import annotations

import types
from typing import Any

from miles_core.models.family import MODEL_FAMILIES, ModelFamily


def attention_refuses(config: Any) -> str | None:
    """Why the runner's attention and MLP are not this config's (None: they are). `config`: an
    HF config, or any object with its fields as attributes."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (the runner implements 'default')"
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or []
    ):
        return "sliding-window attention layers (the runner implements full attention)"
    if getattr(config, "attention_bias", False):
        return "attention_bias (the runner's projections have no bias)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the runner implements silu)"
    return None


@MODEL_FAMILIES.register("qwen3")
class Qwen3(ModelFamily):
    hf_class = "Qwen3ForCausalLM"
    chat_template = "qwen3"
    fast_forward = "miles_core.models.qwen3.runner_forward:RunnerForward"

    def hf_config(self, preset, common):
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=preset.head_dim, rope_theta=10000.0)

    def runner_refuses(self, config):
        return attention_refuses(config)

    def runner(self, model, **kwargs):
        from miles_core.models.qwen3.runner import Qwen3Runner

        return Qwen3Runner(model, **kwargs)

    def invariant_refuses(self, config):
        return self.runner_refuses(config)  # the same decoder as the runner's

    def invariant(self, model):
        from miles_core.models.qwen3.invariant import InvariantQwen3

        reason = self.invariant_refuses(model.config)
        if reason is not None:
            raise ValueError(f"no invariant forward for this model: {reason}")
        return InvariantQwen3(model)

    def megatron_invariant_refuses(self, hf):
        from miles_core.models.check import moe_sizes

        if moe_sizes(hf):
            return "mixture-of-experts layers (Megatron's invariant forward is dense)"
        return self.invariant_refuses(types.SimpleNamespace(**hf))

    def megatron_invariant(self, model, hf):
        from miles_core.models.qwen3.invariant import MegatronInvariantQwen3

        reason = self.megatron_invariant_refuses(hf)
        if reason is not None:
            raise ValueError(f"no invariant forward for this model: {reason}")
        return MegatronInvariantQwen3(model, hf)

    def megatron_refuses(self, hf):
        bad = []
        rope = hf.get("rope_parameters") or {}
        if hf.get("attention_bias"):
            bad.append("attention_bias: true")
        if hf.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act {hf.get('hidden_act')!r} (silu only)")
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            bad.append(f"rope scaling {rope.get('rope_type') or hf.get('rope_scaling')!r}")
        if hf.get("use_sliding_window"):
            bad.append("sliding-window attention")
        return bad

    def megatron_names(self):
        from miles_core.models.qwen3.megatron import NAMES

        return NAMES
