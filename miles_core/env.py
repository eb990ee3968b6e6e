"""Process environment defaults: offline model hub, no telemetry, patient ephemeral Prefect."""

import os

DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_defaults() -> None:
    for k, v in DEFAULTS.items():
        os.environ.setdefault(k, v)
