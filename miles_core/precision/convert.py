"""`miles convert`: an HF checkpoint (float safetensors) → the same model in a low-precision
format, as SGLang loads it: the quantized tensors under their checkpoint names, the
`quantization_config` in config.json (and `hf_quant_config.json` for NVFP4), safetensors with
`{"format": "pt"}` metadata and an index. The plan (format + keep-list) is the one a run uses
(`rollout.precision`, `precision.keep_bf16`), so a run's engine and SGLang serve the same
bytes. The source is read whole and checked before anything is written; DST must not exist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles_core.precision.plan import QuantPlan, prefix_of

# formats whose SGLang method quantizes dense linear layers (SGLang 0.5's mxfp4 quantizes MoE
# experts only: its dense layers load unquantized, so a dense MXFP4 checkpoint would not load)
LOADABLE = ("fp8", "fp8_block", "mxfp8", "nvfp4", "int4")
WEIGHTS = "model.safetensors"


def read_weights(src: Path) -> dict[str, torch.Tensor]:
    index = src / f"{WEIGHTS}.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else [p.name for p in sorted(src.glob("*.safetensors"))]
    )
    if not files:
        raise ValueError(f"{src} holds no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(src / f))
    return out


def write_weights(dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({n: t.contiguous() for n, t in tensors.items()}, dst / WEIGHTS, {"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": size},
        "weight_map": dict.fromkeys(sorted(tensors), WEIGHTS),
    }
    (dst / f"{WEIGHTS}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _model_file(name: str) -> bool:
    """A file of the model directory besides its weights (not a trainer's optimizer state)."""
    return name.endswith((".jinja", ".txt")) or name.startswith(
        ("tokenizer", "generation_config", "special_tokens", "vocab", "added_tokens", "chat_")
    )


def convert_checkpoint(src: str | Path, dst: str | Path, plan: QuantPlan) -> dict:
    """Writes the converted checkpoint; returns {format, quantized, kept, bytes}."""
    src, dst = Path(src), Path(dst)
    if plan.name not in LOADABLE:
        raise ValueError(
            f"convert --to {plan.name}: SGLang's {plan.name} method quantizes MoE experts only "
            f"(its dense linear layers load unquantized); choose one of {', '.join(LOADABLE)}"
        )
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a model directory (no config.json)")
    if dst.exists():
        raise FileExistsError(f"{dst} exists: convert writes a new directory")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config']})")
    weights = read_weights(src)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    refused = plan.refused(shapes)
    if refused:
        raise ValueError("; ".join(refused))
    out = plan.export((n, t.float() if t.is_floating_point() else t) for n, t in weights.items())
    quantized = [n for n, s in shapes.items() if plan.quantized(n, s)]
    for n in quantized:
        p = prefix_of(n)
        out.update({p + k: v for k, v in plan.fmt.checkpoint_only(shapes[n]).items()})
    ignore = plan.ignored_modules(shapes, bool(config.get("tie_word_embeddings")))
    dst.mkdir(parents=True)
    try:
        write_weights(dst, out)
        config["quantization_config"] = plan.fmt.quantization_config(ignore)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in plan.fmt.side_files(ignore).items():
            (dst / name).write_text(json.dumps(content, indent=2) + "\n")
        for f in src.iterdir():  # tokenizer, generation config, chat template
            if f.is_file() and _model_file(f.name) and not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return {
        "format": plan.name,
        "quantized": len(quantized),
        "kept": len(ignore),
        "bytes": sum(t.numel() * t.element_size() for t in out.values()),
        "source_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
    }


QUANTIZED_DIR = "quantized"  # inside a checkpoint of a quantized run


def save_quantized(checkpoint: Path, plan: QuantPlan) -> Path | None:
    """A checkpoint's float HF files converted beside them (`<checkpoint>/quantized`), when the
    plan's format is one SGLang loads and the trainer saved an HF directory."""
    if plan.name not in LOADABLE or not (checkpoint / "config.json").is_file():
        return None
    convert_checkpoint(checkpoint, checkpoint / QUANTIZED_DIR, plan)
    return checkpoint / QUANTIZED_DIR
