"""One adapter's tensors and config, and its peft directory (`adapter_config.json` +
`adapter_model.safetensors`, what `peft.PeftModel.from_pretrained` loads on the base)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from miles_core.lora.names import peft_key, split_peft_key, wire_name

CONFIG_FILE = "adapter_config.json"
ADAPTERS_DIR = "adapters"  # a checkpoint's adapters: adapters/<name>/ each
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(
    rank: int,
    alpha: float,
    modules: list[str],
    dropout: float = 0.0,
    rslora: bool = False,
    base: str | None = None,
) -> dict[str, Any]:
    """The adapter_config.json peft writes for a LoRA adapter of a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def config_scaling(config: dict[str, Any]) -> float:
    """peft's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


@dataclass
class Adapter:
    name: str
    config: dict[str, Any]  # peft's adapter_config
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module → (A [r, in], B [out, r])

    @property
    def scaling(self) -> float:
        return config_scaling(self.config)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for module, (a, b) in self.weights.items():
            out[peft_key(module, "lora_A")] = a
            out[peft_key(module, "lora_B")] = b
        return out

    def wire_tensors(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """Its tensors by wire name, under `name` (default: its own)."""
        name = name or self.name
        out = {}
        for module, (a, b) in self.weights.items():
            out[wire_name(name, module, "lora_A")] = a
            out[wire_name(name, module, "lora_B")] = b
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)

    def save(self, directory: str | Path, storage_options: dict | None = None) -> int:
        """Writes the peft directory (local, or an fsspec URL); returns the weights file's bytes."""
        fs, base = fsspec.core.url_to_fs(str(directory), **(storage_options or {}))
        fs.makedirs(base, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.peft_tensors().items()}
        data = save(tensors, metadata={"format": "pt"})
        with fs.open(f"{base}/{WEIGHTS_FILE}", "wb") as f:
            f.write(data)
        with fs.open(f"{base}/{CONFIG_FILE}", "w") as f:
            f.write(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        return len(data)


def set_base_model(directory: Path, base: str | None) -> None:
    """Points a saved adapter's config at its base model (`base_model_name_or_path`)."""
    file = Path(directory) / CONFIG_FILE
    config = json.loads(file.read_text())
    config["base_model_name_or_path"] = base
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def pairs_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} from peft checkpoint keys; ValueError for a key that is not an adapter
    tensor or a module with one half missing."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, part = split_peft_key(key)
        halves.setdefault(module, {})[part] = t
    out = {}
    for module, parts in halves.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"adapter module {module!r} lacks {sorted({'lora_A', 'lora_B'} - set(parts))}"
            )
        out[module] = (parts["lora_A"], parts["lora_B"])
    return out


CONFIG_MAX_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes


def read_adapter_dir(path: str | Path, name: str, max_bytes: int | None = None) -> Adapter:
    """An adapter from a peft directory; ValueError (naming the file) for one that is not: files
    missing, larger than `max_bytes` (an engine passes what its model could hold), a config that
    is not a JSON object, tensors that are not safetensors."""
    path = Path(path)
    cfg_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path} is not a peft adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    if cfg_file.stat().st_size > CONFIG_MAX_BYTES:
        raise ValueError(f"{cfg_file}: larger than {CONFIG_MAX_BYTES} bytes")
    if max_bytes is not None and weights_file.stat().st_size > max_bytes:
        raise ValueError(f"{weights_file}: more bytes than this model's adapters could hold")
    try:
        config = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file}: not a JSON object")
    try:
        tensors = load_file(str(weights_file))
    except SafetensorError as e:
        raise ValueError(f"{weights_file}: not safetensors ({e})") from None
    return Adapter(name, config, pairs_of(tensors))


def engine_spec(settings: Any, model: torch.nn.Module) -> dict[str, Any] | None:
    """What a LoRA run's engines are started with (`train.lora` settings, or None): its adapters
    declared by config (served as zeros until the first push, which computes the base exactly
    like the trainer's fresh adapter), and every request required to name one."""
    if settings is None:
        return None
    from miles_core.lora.targets import resolve_targets

    modules = resolve_targets(model, settings.target_modules, settings.exclude_modules)
    config = peft_config(settings.rank, settings.alpha, modules, settings.dropout, settings.rslora)
    return {
        "adapters": {name: config for name in settings.adapters},
        # a push to an engine without in-place replacement briefly holds two versions of each
        # adapter (versions.py); SGLang needs at least its max_loras_per_batch (8 by default)
        "max_loaded": max(2 * len(settings.adapters), 8),
        "required": True,
    }
