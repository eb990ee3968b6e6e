"""A model's parameters as a parallel layout splits them, counted from its HF config alone.

transformers builds the model on the meta device (`models/check.py: tensor_shapes`: shapes,
no memory), so the counts are the architecture's own, for any family transformers knows. Each
tensor is one of:

- `embedding` / `head`: the vocabulary rows (split by tp; first and last pipeline stage);
- `dense`: a layer's attention and MLP weights (split by tp);
- `experts`: a layer's routed experts (split by ep × etp);
- `replicated`: norms, biases of norms and the router (every rank of a stage holds them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from miles_core.models.check import moe_sizes, tensor_shapes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a router's weight and its score-correction bias: small, replicated on every rank
_ROUTER = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


@dataclass
class LayerSizes:
    dense: int = 0
    experts: int = 0
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.replicated


@dataclass
class ModelSizes:
    embedding: int = 0
    head: int = 0  # the output layer (0 when tied to the embedding) and the final norm
    layers: list[LayerSizes] = field(default_factory=list)
    experts_per_layer: int = 0
    experts_per_token: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.head + sum(layer.total for layer in self.layers)

    @property
    def active(self) -> int:
        """Parameters one token computes with: all but the routed experts it is not sent to."""
        if not self.experts_per_layer:
            return self.total
        routed = sum(layer.experts for layer in self.layers)
        return self.total - routed + routed * self.experts_per_token // self.experts_per_layer


def model_sizes(hf: dict[str, Any]) -> ModelSizes:
    """The parameter counts of the model `hf` (a config.json as a dict) describes."""
    shapes = tensor_shapes(hf)
    n = int(hf["num_hidden_layers"])
    sizes = ModelSizes(layers=[LayerSizes() for _ in range(n)])
    moe = moe_sizes(hf)
    sizes.experts_per_layer = moe.get("experts", 0)
    sizes.experts_per_token = int(hf.get("num_experts_per_tok") or hf.get("moe_router_topk") or 0)
    for name, shape in shapes.items():
        count = math.prod(shape)
        m = _LAYER.match(name)
        if m is None:
            if "embed_tokens" in name:
                sizes.embedding += count
            else:  # lm_head, the final norm
                sizes.head += count
            continue
        layer = sizes.layers[int(m.group(1))]
        if ".mlp.experts." in name:
            layer.experts += count
        elif len(shape) == 1 or _ROUTER.search(name):
            layer.replicated += count
        else:
            layer.dense += count
    return sizes
