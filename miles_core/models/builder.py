"""Build, save and load tiny causal LMs (a preset of a model family, `models/<family>/`) as
ordinary Hugging Face directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from miles_core.models import moe
from miles_core.models.family import MODEL_FAMILIES
from miles_core.models.presets import PRESETS
from miles_core.models.tokenizer import build_tokenizer

# Fields that must agree between a model and a checkpoint of it.
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    *moe.CONFIG_KEYS,  # mixture of experts (absent, None, in a dense config)
    "use_qk_norm",
)


def preset_config(
    preset: str, vocab_size: int, pad_token_id: int, eos_token_id: int, context: int | None = None
) -> PretrainedConfig:
    """The preset's architecture; `context` replaces its max_position_embeddings (RoPE has no
    weights: the same seed gives the same weights at any context)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=context or p.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        attention_dropout=0.0,
        dtype="float32",
    )
    return MODEL_FAMILIES.get(p.family).hf_config(p, common)


def build_model(
    preset: str, seed: int, context: int | None = None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """A randomly initialised model of the preset and its tokenizer; same seed, same weights."""
    tok = build_tokenizer()
    config = preset_config(preset, len(tok), tok.pad_token_id, tok.eos_token_id, context)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        MODEL_FAMILIES.get(PRESETS[preset].family).init_extra(model, seed)
    model.eval()
    return model, tok


def save_hf_dir(
    model: torch.nn.Module, tok: PreTrainedTokenizerBase, directory: str | Path
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))
    return directory


def load_hf_dir(directory: str | Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    directory = str(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(directory)
    return model, tok


def architecture_of(config_or_dir) -> dict:
    """The architecture fields of a config object, a config dict, or an HF directory."""
    if isinstance(config_or_dir, str | Path):
        with open(Path(config_or_dir) / "config.json") as f:
            config_or_dir = json.load(f)
    if not isinstance(config_or_dir, dict):
        config_or_dir = config_or_dir.to_dict()
    return {k: config_or_dir.get(k) for k in ARCHITECTURE_FIELDS}


def check_same_architecture(expected: dict, found: dict, where: str) -> None:
    diffs = {k: (expected[k], found.get(k)) for k in expected if expected[k] != found.get(k)}
    if diffs:
        detail = ", ".join(
            f"{k}: model has {a!r}, checkpoint has {b!r}" for k, (a, b) in diffs.items()
        )
        raise ValueError(f"checkpoint {where} does not match the model config ({detail})")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
