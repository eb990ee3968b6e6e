"""Model families, presets, the char tokenizer, HF directories. The names below load their
module (and torch, transformers) on first use, so a command that builds no model imports neither."""

from __future__ import annotations

import importlib

_WHERE = {
    "architecture_of": "builder",
    "build_model": "builder",
    "check_same_architecture": "builder",
    "count_parameters": "builder",
    "load_hf_dir": "builder",
    "save_hf_dir": "builder",
    "PRESETS": "presets",
    "build_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
