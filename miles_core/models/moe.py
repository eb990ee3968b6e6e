"""Mixture-of-experts pieces the rest of the tree shares: the HF config keys that describe an MoE
model, and the per-token field routing replay (R3) records, in SGLang's names and layout.

A `/generate` request asks for the routes with `return_routed_experts: true`; the response then
carries `meta_info.routed_experts`: base64 of little-endian int32, shape [tokens − 1, MoE layers,
top_k] (row j: the experts each MoE layer routed input position j to, for every position the
engine processed: the prompt's and every generated token but the last). `ROUTES` declares that
field once; its shape and bounds come from the model (`TokenField.for_model`), and from there it
travels the generic per-token channel (`token_fields.py`, `sequence`-aligned, so an
abort-continuation or a later session turn extends the rows it already has) to the trainer's
routers (`train/routing_replay.py`), at (T − 1)·L·k·4 bytes a sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miles_core.token_fields import TokenField

# the number of routed experts, by family: Mixtral, GLM4-MoE / DeepSeek, Qwen3-MoE
EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")
# every HF config key of an MoE layout (absent, or None, in a dense config)
CONFIG_KEYS = (
    *EXPERT_COUNT_KEYS[:2],
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
)
PATH = "miles_core.models.moe:ROUTES"  # how a config names the field (rollout.token_fields)


def is_moe_layer(mlp: Any) -> bool:
    """Whether an HF decoder layer's MLP is a mixture of experts (a router `gate`, `experts`)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def routes_shape(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The routes field's per-token shape (MoE layers, top_k) and bounds [0, experts) for a
    model's HF config (a dict); ValueError for a dense model."""
    from miles_core.models.check import moe_sizes

    moe = moe_sizes(hf_config)
    top_k = int(hf_config.get("num_experts_per_tok") or 0)
    if not moe or not top_k:
        raise ValueError(
            "routing replay records each token's experts: the model has no mixture-of-experts "
            "layers (train.routing_replay and train.check_routing_replay need an MoE model)"
        )
    return {"shape": (moe["moe_layers"], top_k), "bounds": (0, moe["experts"])}


ROUTES = TokenField(
    name="routed_experts",
    dtype="int32",
    wire_key="routed_experts",
    encoding="base64",
    align="sequence",
    request_flag="return_routed_experts",  # SGLang's GenerateReqInput field
    from_model=routes_shape,
    description="the experts each MoE layer routed each input position to (R3)",
)


def routes_field(moe_layers: int, top_k: int, experts: int | None = None) -> TokenField:
    """`ROUTES` for a model with `moe_layers` MoE layers routing to `top_k` of `experts`
    experts (indices checked against it when given)."""
    bounds = None if experts is None else (0, experts)
    return ROUTES.bound(shape=(moe_layers, top_k), bounds=bounds)


def encode(routes: np.ndarray) -> str:
    """[positions, MoE layers, top_k] integers → the `meta_info.routed_experts` string."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routed experts have shape {routes.shape}, expected 3 dimensions")
    return routes_field(routes.shape[1], routes.shape[2]).encode(routes)


def decode(raw: str, moe_layers: int, top_k: int) -> np.ndarray:
    """The `meta_info.routed_experts` string → int32 [positions, moe_layers, top_k]; raises
    ValueError when its bytes are not whole rows of that shape."""
    return routes_field(moe_layers, top_k).decode(raw)
