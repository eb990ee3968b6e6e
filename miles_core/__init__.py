"""miles_core: the runtime library of the RL post-training system (never imports prefect).

Importing it sets the process environment defaults every part relies on (offline model hub, no
telemetry, quiet transformers); a variable already set is left as it is.
"""

import os

DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    # transformers quiet (errors only) and without progress bars, set without importing it: a
    # command that needs no model (`miles --help`, a refused config) does not load it
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def _apply_defaults() -> None:
    for k, v in DEFAULTS.items():
        os.environ.setdefault(k, v)


_apply_defaults()
