"""The run configuration: one pydantic tree, validated before anything starts, one module per
section (`rollout.py` is the `rollout:` section, ...), `run.py` the whole and the checks across
sections, `loading.py` YAML plus overrides.

The same object is the Prefect flow parameter (the UI renders it as a form), the YAML file a user
edits, and the flattened MLflow params of the run. A plug-in chosen by name (`rollout.engine`,
`weight_sync.transport`, ...) takes its own settings under the key's `*_options`, validated
against the plug-in's `Options` class (`miles_core/plugins.py`).
"""

from miles_core.config.agent import RUN_COMMAND, AgentConfig, SandboxConfig
from miles_core.config.checkpoint import CheckpointConfig
from miles_core.config.data import DataConfig
from miles_core.config.eval import EvalConfig
from miles_core.config.loading import load_config, parse_overrides
from miles_core.config.model import ModelConfig
from miles_core.config.network import NetworkConfig
from miles_core.config.rollout import RolloutConfig
from miles_core.config.run import RunConfig
from miles_core.config.sft import SFTConfig
from miles_core.config.tracking import TrackingConfig
from miles_core.config.train import OptimConfig, ParallelConfig, TrainConfig
from miles_core.config.weight_sync import WeightSyncConfig

__all__ = [
    "RUN_COMMAND",
    "AgentConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "NetworkConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "SFTConfig",
    "TrackingConfig",
    "TrainConfig",
    "WeightSyncConfig",
    "load_config",
    "parse_overrides",
]
