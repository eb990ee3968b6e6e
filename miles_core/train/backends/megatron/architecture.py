"""Which HF architectures the Megatron backend builds: those of a model family (`models/<family>/`)
with a Megatron conversion, less what that family refuses of a config (`megatron_refuses`).
Anything else is refused before the run starts, with what differs. Pure Python."""

from __future__ import annotations

from typing import Any

from miles_core.models.family import MODEL_FAMILIES, ModelFamily, family_of


def converted_families() -> list[str]:
    """The model families with a Megatron conversion (each family module imported)."""
    return [
        f.name
        for f in MODEL_FAMILIES.values()
        if type(f).megatron_names is not ModelFamily.megatron_names
    ]


def check_architecture(hf: dict[str, Any], where: str = "the model") -> ModelFamily:
    """The model family of the HF config `hf` (a dict); ValueError naming what of it the
    converter cannot map."""
    model_type = hf.get("model_type")
    family = family_of(model_type)
    if family is None or type(family).megatron_names is ModelFamily.megatron_names:
        raise ValueError(
            f"train.backend megatron: {where} is a {model_type!r} model; the HF ↔ Megatron "
            f"converter knows {', '.join(converted_families())} (a model family's "
            "megatron_names: miles_core/models/README.md)"
        )
    bad = family.megatron_refuses(hf)
    if rope_theta(hf) != int(rope_theta(hf)):
        bad.append(f"rope_theta {rope_theta(hf)} (Megatron's rotary base is an integer)")
    if bad:
        raise ValueError(
            f"train.backend megatron: {where} uses {', '.join(bad)}, which the Megatron "
            "backend does not build"
        )
    return family


def rope_theta(hf: dict[str, Any]) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
