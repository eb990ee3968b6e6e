"""The BF16 keep-list (`precision.keep_bf16`) as two matchers over the same rule: one over HF
tensor names (conversion, the engine, weight pushes, the FSDP2 trainer), one over Megatron's
(its trainer). They must select the same tensors; tests/test_precision_plan.py checks that
every Megatron tensor is kept exactly when the HF tensors it holds are.

Which tensors a format quantizes at all: the linear weights, i.e. 2-D `*.weight` tensors other
than the embedding, and the routed experts' 3-D tensors. Embeddings and norms never are."""

from __future__ import annotations

import re
from dataclasses import dataclass

HF_GROUPS = {
    "lm_head": r"^lm_head\.",
    "router": r"\.mlp\.gate\.",
    "attention": r"\.self_attn\.",
    "dense_mlp": r"\.mlp\.(gate|up|down)_proj\.",
    "experts": r"\.mlp\.experts\.",
    "shared_experts": r"\.mlp\.shared_experts\.",
}
MEGATRON_GROUPS = {
    "lm_head": r"^output_layer\.",
    "router": r"\.mlp\.router\.",
    "attention": r"\.self_attention\.",
    "dense_mlp": r"\.mlp\.linear_fc[12]\.",
    "experts": r"\.mlp\.experts\.",
    "shared_experts": r"\.mlp\.shared_experts\.",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EMBEDDING = "model.embed_tokens."


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A tensor a format may quantize: a linear layer's weight (HF names)."""
    if name.startswith(EMBEDDING):
        return False
    if len(shape) == 2 and name.endswith(".weight"):
        return True
    return len(shape) == 3 and ".mlp.experts." in name


@dataclass(frozen=True)
class KeepList:
    """`precision.keep_bf16` for a model of `layers` decoder layers."""

    modules: tuple[str, ...]
    first_layers: int
    last_layers: int
    names: tuple[str, ...]
    layers: int

    @classmethod
    def of(cls, keep, layers: int) -> KeepList:
        return cls(
            tuple(keep.modules), keep.first_layers, keep.last_layers, tuple(keep.names), layers
        )

    def _layer_kept(self, layer: int) -> bool:
        return layer < self.first_layers or layer >= self.layers - self.last_layers

    def _kept(self, name: str, groups: dict[str, str], layer: re.Pattern) -> bool:
        if any(re.search(groups[m], name) for m in self.modules):
            return True
        m = layer.match(name)
        return m is not None and self._layer_kept(int(m.group(1)))

    def keeps_hf(self, name: str) -> bool:
        """HF tensor `name` stays in high precision."""
        return self._kept(name, HF_GROUPS, _HF_LAYER) or any(n in name for n in self.names)

    def keeps_megatron(self, name: str, hf_names: list[str]) -> bool:
        """Megatron tensor `name` (global layer numbers) stays in high precision; `hf_names`:
        the HF tensors it holds (what `names` entries are matched against)."""
        if self._kept(name, MEGATRON_GROUPS, _MEGATRON_LAYER):
            return True
        return any(n in h for n in self.names for h in hf_names)

    def refused(self, hf_names: list[str]) -> list[str]:
        """What in the keep-list cannot apply to a model with these tensors."""
        out = []
        if self.first_layers > self.layers or self.last_layers > self.layers:
            out.append(
                f"precision.keep_bf16 first_layers {self.first_layers} / last_layers "
                f"{self.last_layers}: the model has {self.layers} layers"
            )
        for n in self.names:
            if not any(n in h for h in hf_names):
                out.append(f"precision.keep_bf16.names {n!r} names no tensor of the model")
        return out
