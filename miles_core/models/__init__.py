from miles_core.models.builder import (
    architecture_of,
    build_model,
    check_same_architecture,
    count_parameters,
    load_hf_dir,
    save_hf_dir,
)
from miles_core.models.presets import PRESETS
from miles_core.models.tokenizer import build_tokenizer

__all__ = [
    "PRESETS",
    "architecture_of",
    "build_model",
    "build_tokenizer",
    "check_same_architecture",
    "count_parameters",
    "load_hf_dir",
    "save_hf_dir",
]
