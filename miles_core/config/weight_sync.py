"""The `weight_sync:` section: how new weights reach the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_core.config.base import PluginOptionsField, Strict, options_field, plugin_validators
from miles_core.weights.transport import TRANSPORTS


class WeightSyncConfig(Strict):
    transport: str = Field(
        "colocated",
        description="a transport in miles_core/weights/transports/ or 'package.module:Class': "
        "colocated (engine in the trainer's process); shared_memory, disk, broadcast or p2p "
        "(engine servers, rollout.engine: server)",
    )
    transport_options: PluginOptionsField = options_field("transport")
    bucket_mb: int = Field(64, gt=0)
    check_equal: bool = Field(
        False, description="verify engine weights bitwise after every push (slow)"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of pushed weights: float32 is exact; bfloat16 halves the bytes and "
        "keeps disk deltas small, and engines then hold bf16-rounded weights (a train/rollout "
        "mismatch that train.loss_options.off_policy corrects and train_rollout_* metrics show)",
    )

    _transport, _transport_options = plugin_validators("transport", lambda: TRANSPORTS)
