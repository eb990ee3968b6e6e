"""miles_core: the runtime library of the RL post-training system (never imports prefect)."""

from miles_core.env import apply_defaults

apply_defaults()

from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.disable_progress_bar()
_hf_logging.set_verbosity_error()
