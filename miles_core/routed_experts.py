"""Routed experts: what a mixture-of-experts engine records per token for routing replay (R3),
in SGLang's names and layout.

A `/generate` request asks with `return_routed_experts: true`; the response then carries
`meta_info.routed_experts`: base64 of little-endian int32, shape [tokens − 1, MoE layers, top_k]
(row j: the experts each MoE layer routed input position j to, for every position the engine
processed: the prompt's and every generated token but the last). It reaches `Sample` through the
per-token channel as the `routed_experts` field (`token_fields.py`, `sequence`-aligned, so an
abort-continuation or a later session turn extends the rows it already has), at
(T − 1)·L·k·4 bytes a sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miles_core.models.check import moe_sizes
from miles_core.token_fields import FIELDS, TokenField

REQUEST_FLAG = "return_routed_experts"  # GenerateReqInput field
WIRE_KEY = "routed_experts"  # meta_info key
FIELD_NAME = "routed_experts"


def routed_experts_field(moe_layers: int, top_k: int, experts: int | None = None) -> TokenField:
    """The `routed_experts` token field of a model with `moe_layers` MoE layers routing to
    `top_k` of `experts` experts (indices checked against it when given)."""
    return TokenField(
        name=FIELD_NAME,
        dtype="int32",
        shape=(moe_layers, top_k),
        wire_key=WIRE_KEY,
        encoding="base64",
        align="sequence",
        bounds=None if experts is None else (0, experts),
        description="the experts each MoE layer routed each input position to (R3)",
    )


def encode(routes: np.ndarray) -> str:
    """[positions, MoE layers, top_k] integers → the `meta_info.routed_experts` string."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routed experts have shape {routes.shape}, expected 3 dimensions")
    return routed_experts_field(routes.shape[1], routes.shape[2]).encode(routes)


def decode(raw: str, moe_layers: int, top_k: int) -> np.ndarray:
    """The `meta_info.routed_experts` string → int32 [positions, moe_layers, top_k]; raises
    ValueError when its bytes are not whole rows of that shape."""
    return routed_experts_field(moe_layers, top_k).decode(raw)


def shape_of(hf_config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, routed experts) of a model's HF config (a dict); None for a dense
    model."""
    moe = moe_sizes(hf_config)
    if not moe:
        return None
    return moe["moe_layers"], int(hf_config.get("num_experts_per_tok") or 0), moe["experts"]


def declare(hf_config: dict[str, Any]) -> TokenField:
    """Declares the `routed_experts` field for this model (its layers and top_k), in place of
    another model's declaration; raises ValueError for a dense model."""
    shape = shape_of(hf_config)
    if shape is None or not shape[1]:
        raise ValueError("routed experts: the model has no mixture-of-experts layers")
    f = routed_experts_field(*shape)
    if FIELD_NAME in FIELDS and FIELDS.get(FIELD_NAME) != f:
        FIELDS.unregister(FIELD_NAME)
    return FIELDS.register(f.name, f)
