"""A model family: one HF architecture, and everything the tree needs to build, serve and train it.

A family is a folder `models/<model_type>/` (the name is the HF config's `model_type`, which is
also what a preset's `family` names) whose `__init__.py` registers a `ModelFamily` subclass:

    @MODEL_FAMILIES.register("qwen3")
    class Qwen3(ModelFamily): ...

What a family provides, each part optional but the first:

- `hf_config`: the HF config of a preset's sizes (`presets.py`), `init_extra` for what a random
  init leaves unset; `hf_class`, the model class transformers builds from it.
- `chat_template`: the TITO family (`chat_templates/`) its chat turns render with.
- CPU engine: `runner_refuses` / `runner` (the serving engine's lean forward over a slot KV
  cache) and `fast_forward` (the embedded engine's `BatchForward` factory, an import path).
- True on-policy: `invariant_refuses` / `invariant`, the forward whose numbers do not depend on
  the batch (`true_on_policy/`), run by the engines and the trainer alike.
- Routing replay: `route_weights`, how its routers weigh the experts they chose.
- Megatron: `megatron_refuses`, `megatron_names` (its HF tensor names for each Megatron
  tensor) and `megatron_router` (the `TransformerConfig` router settings).

The checks (`*_refuses`) are pure Python over the config's fields, so they run at config time;
the heavy parts import torch and transformers when called. A model type with no family still
trains and generates through transformers' own modules (the embedded engine, FSDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.plugins import Registry

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from miles_core.models.presets import ModelPreset


class ModelFamily:
    name: ClassVar[str] = ""
    hf_class: ClassVar[str] = ""  # the model class transformers builds (e.g. Qwen3ForCausalLM)
    chat_template: ClassVar[str] = ""  # the TITO family its chat turns render with
    fast_forward: ClassVar[str | None] = None  # `pkg.mod:factory` of the embedded engine

    # ------------------------------------------------------------------ building
    def hf_config(self, preset: ModelPreset, common: dict[str, Any]) -> PretrainedConfig:
        """The HF config of `preset`; `common` holds the fields every family shares (sizes,
        the tokenizer's ids, tied embeddings, fp32)."""
        raise ValueError(f"model family {self.name!r} builds no preset")

    def init_extra(self, model: torch.nn.Module, seed: int) -> None:
        """Sets, seeded, what a random init leaves at zero and a trained model does not."""

    # ------------------------------------------------------------------ the CPU engines
    def runner_refuses(self, config: Any) -> str | None:
        """Why the serving engine's runner would not compute this config's forward exactly
        (None: it does). `config`: an HF config, or any object with its fields as attributes."""
        return (
            f"model_type {self.name!r} has no serving runner (the embedded engine runs any "
            "model transformers loads)"
        )

    def runner(self, model: torch.nn.Module, **kwargs: Any) -> Any:
        """The serving engine's runner over `model` (`slots`, `max_len`, `dtype`)."""
        raise ValueError(self.runner_refuses(model.config) or "no serving runner")

    # ------------------------------------------------------------------ true on-policy
    def invariant_refuses(self, config: Any) -> str | None:
        """Why `invariant` would not compute this config's forward (None: it does); pure
        Python, like `runner_refuses`."""
        return f"model_type {self.name!r} has no invariant forward"

    def invariant(self, model: torch.nn.Module) -> Any:
        """The forward of `train.true_on_policy` over `model`'s parameters (an
        `InvariantModel`, `true_on_policy/forward.py`): the same bits for a token whatever the
        batch, decoded over a KV cache or inside a full forward."""
        raise ValueError(self.invariant_refuses(model.config) or "no invariant forward")

    # MoE: (router, logits, chosen=None) -> (experts [N, k], their weights); given `chosen`
    # (routing replay), those experts, weighed by the same rule
    invariant_route: ClassVar[Any] = None

    def megatron_invariant_refuses(self, hf: dict[str, Any]) -> str | None:
        """Why `megatron_invariant` would not compute this HF config (a dict), or None."""
        return f"model family {self.name!r} has no invariant forward for Megatron"

    def megatron_invariant(self, model: torch.nn.Module, hf: dict[str, Any]) -> Any:
        """`invariant` over a Megatron `GPTModel` of this family (one tensor-parallel and
        pipeline rank), whose forward `install` then routes through it."""
        raise ValueError(f"model family {self.name!r} has no invariant forward for Megatron")

    # ------------------------------------------------------------------ routing replay
    route_weights: ClassVar[Any] = None  # (router, logits, chosen [N, k]) -> weights [N, k]

    # ------------------------------------------------------------------ Megatron
    def megatron_refuses(self, hf: dict[str, Any]) -> list[str]:
        """What of the HF config (a dict) the Megatron backend does not build ([]: nothing)."""
        return [f"model_type {self.name!r} (no Megatron conversion)"]

    def megatron_names(self) -> Any:
        """The family's HF tensor names for each Megatron tensor (`HFNames`)."""
        raise ValueError(f"model family {self.name!r} has no Megatron conversion")

    def megatron_router(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The `TransformerConfig` router fields of an MoE config ({}: dense)."""
        return {}


def _instance(obj: Any, name: str) -> ModelFamily:
    if isinstance(obj, type) and issubclass(obj, ModelFamily):
        obj = obj()
    if not isinstance(obj, ModelFamily):
        raise ValueError(f"model family {name!r} is not a ModelFamily: {obj!r}")
    obj.name = name  # the registered name is the HF model_type it answers to
    return obj


MODEL_FAMILIES: Registry[ModelFamily] = Registry(
    "model family", package="miles_core.models", example="package.module:Family", load=_instance
)


def family_of(model_type: str | None) -> ModelFamily | None:
    """The family registered for an HF `model_type`, or None."""
    if not model_type or model_type not in MODEL_FAMILIES:
        return None
    try:
        return MODEL_FAMILIES.get(model_type)
    except ValueError:  # a module of models/ with that name that is no family
        return None


def runner_refuses(config: Any) -> str | None:
    """Why the serving engine's runner would not compute `config`'s forward exactly (None: it
    does): its family's `runner_refuses`. `config`: an HF config, or any object with its fields
    as attributes."""
    model_type = getattr(config, "model_type", None)
    family = family_of(model_type)
    if family is None:
        return (
            f"model_type {model_type!r} has no model family here (models/<family>/; the "
            "embedded engine runs any model transformers loads)"
        )
    return family.runner_refuses(config)


def serving_runner(model: torch.nn.Module, **kwargs: Any) -> Any:
    """The serving engine's runner over `model`, from its family (`slots`, `max_len`, `dtype`);
    ValueError saying why when there is none for it."""
    reason = runner_refuses(model.config)
    if reason is not None:
        raise ValueError(f"the serving engine's runner cannot run this model: {reason}")
    return family_of(model.config.model_type).runner(model, **kwargs)
