"""What every config section shares: strict models (unknown keys and NaN/inf refused) and the
engine question several sections ask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from miles_core.plugins import NoOptions, PluginOptions, Registry


class Strict(BaseModel):
    # allow_inf_nan=False: `train.lr: .inf` or a NaN anywhere in the tree is refused up front
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def in_trainer_process(engine: str) -> bool:
    """Whether engine `engine` runs in the trainer's process (it takes weights only as tensors
    handed over there), as opposed to engine servers."""
    from miles_core.engines.registry import ENGINES

    return ENGINES.get(engine).in_trainer_process()


# a plug-in's options: its own pydantic model, shown to forms as a free mapping
PluginOptionsField = Annotated[
    SerializeAsAny[PluginOptions],
    WithJsonSchema({"type": "object", "additionalProperties": True}),
]


def options_field(key: str) -> Any:
    """The `<key>_options` field beside a plug-in key: validated by `plugin_options`."""
    return Field(
        default_factory=dict,
        validate_default=True,
        description=f"settings of the chosen {key}, as its Options class declares them",
    )


def plugin_validators(key: str, registry: Callable[[], Registry]) -> tuple[Any, Any]:
    """The two validators of plug-in key `key` and its `<key>_options`, for a section's body
    (`_engine, _engine_options = plugin_validators("engine", lambda: ENGINES)`): the name is a
    registered one or an import path (the registry's error names the known ones), the options
    are the plug-in's. `registry` is called when validating (a registry may import torch)."""

    def known(cls, name: str) -> str:
        return registry().check(name)

    def options(cls, raw: Any, info: ValidationInfo) -> PluginOptions:
        return plugin_options(registry(), raw, info)

    return (
        field_validator(key)(classmethod(known)),
        field_validator(f"{key}_options", mode="before")(classmethod(options)),
    )


def plugin_options(registry: Registry, raw: Any, info: ValidationInfo) -> PluginOptions:
    """`raw` validated against the options of the plug-in the section names in its
    registry's key (declared before the options field)."""
    name = info.data.get(registry.setting.rpartition(".")[2])
    if name is None:  # the name itself was refused: that is the error to read
        return NoOptions()
    return registry.options(name, raw)
