"""Preflight of a starting model without loading it: its `config.json` sizes, the headers of its
safetensors files (dtypes, shapes, byte spans against the file's size, so a truncated or foreign
file is refused), the embedding's shape against the config, and a memory estimate of the run
against what the machine has (a `vocab_size` of 1e8 is refused here, not by an allocation of
25 GB later). Reads a few bytes of each file: the header is at the start of a safetensors file
(8-byte little-endian length, then JSON)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import psutil
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from miles_core.models.moe import EXPERT_COUNT_KEYS

# safetensors dtypes and their sizes in bytes
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# bytes per parameter of a CPU run, at least: fp32 weights, gradients and two Adam moments in
# the trainer (16) and the rollout engine's fp32 copy (4)
BYTES_PER_PARAM = 20
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _int_field(cfg: dict, key: str, where: str, required: bool = True) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            raise ValueError(f"{where}: config.json has no {key!r}")
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or value <= 0:
        raise ValueError(f"{where}: config.json {key} must be a positive integer, got {value!r}")
    return int(value)


def check_model_config(cfg: dict, where: str) -> dict[str, int]:
    """The model's sizes from its config.json, refused when not positive integers."""
    sizes = {k: _int_field(cfg, k, where) for k in SIZE_FIELDS}
    for key in ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = _int_field(cfg, key, where, required=False)
        if value is not None:
            sizes[key] = value
    return sizes  # type: ignore[return-value]


def _count(cfg: dict, *keys: str) -> int:
    """The first of `keys` that holds a non-negative integer (0 if none does)."""
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


def moe_sizes(cfg: dict) -> dict[str, int]:
    """A mixture-of-experts config's sizes ({} for a dense one): routed experts, one expert's
    width, shared experts, and the layers that stay dense (Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step, GLM4-MoE's first_k_dense_replace)."""
    experts = _count(cfg, *EXPERT_COUNT_KEYS)
    if not experts:
        return {}
    return {
        "experts": experts,
        "expert_size": _count(cfg, "moe_intermediate_size"),
        "shared": _count(cfg, "n_shared_experts"),
        "moe_layers": len(moe_layer_indices(cfg)),
    }


def moe_layer_indices(cfg: dict) -> list[int]:
    """The layers of an MoE config that hold experts (all but Qwen3-MoE's mlp_only_layers and
    the layers decoder_sparse_step skips, and GLM4-MoE's first first_k_dense_replace)."""
    n = _count(cfg, "num_hidden_layers")
    dense = set(cfg.get("mlp_only_layers") or [])
    dense |= set(range(_count(cfg, "first_k_dense_replace")))
    step = _count(cfg, "decoder_sparse_step") or 1
    dense |= {i for i in range(n) if (i + 1) % step}
    return [i for i in range(n) if i not in dense]


def estimate_parameters(
    sizes: dict[str, int], tied: bool, moe: dict[str, int] | None = None
) -> int:
    """Parameters of a decoder-only transformer (Llama/Qwen layout) of these sizes; `moe`
    (`moe_sizes`): its MoE layers hold routed and shared experts and a router instead."""
    v, h, n = sizes["vocab_size"], sizes["hidden_size"], sizes["num_hidden_layers"]
    heads = sizes["num_attention_heads"]
    kv = sizes.get("num_key_value_heads", heads)
    head_dim = sizes.get("head_dim", max(1, h // heads))
    inter = sizes.get("intermediate_size", 4 * h)
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    per_layer = attn + 3 * h * inter + 2 * h
    total = v * h * (1 if tied else 2) + n * per_layer + h
    if moe:
        moe_mlp = (moe["experts"] + moe["shared"]) * 3 * h * moe["expert_size"] + moe["experts"] * h
        total += moe["moe_layers"] * (moe_mlp - 3 * h * inter)
    return total


def meta_model(cfg: dict):
    """The HF model `cfg` describes, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of the HF model `cfg` describes, by name."""
    return {n: tuple(p.shape) for n, p in meta_model(cfg).named_parameters()}


def check_memory(
    cfg: dict,
    where: str,
    memory: int | None = None,
    gpu_memory: int | None = None,
) -> int:
    """Refuses a model whose run needs more memory than the machine has available (`memory`,
    default: psutil's available memory). On a CPU run everything is in RAM: at least
    BYTES_PER_PARAM (20) per parameter. With `gpu_memory` (a CUDA trainer: the total memory of
    its GPUs) the trainer's 16 bytes per parameter go there, and RAM holds at least one fp32
    copy while the model loads. Returns the estimate of the RAM part in bytes."""
    sizes = check_model_config(cfg, where)
    params = estimate_parameters(sizes, bool(cfg.get("tie_word_embeddings", False)), moe_sizes(cfg))
    shown = ", ".join(f"{k} {sizes[k]}" for k in SIZE_FIELDS)
    have = psutil.virtual_memory().available if memory is None else memory
    if gpu_memory is not None:
        trainer = params * 16
        if trainer > gpu_memory:
            raise ValueError(
                f"{where}: the model ({shown}) has ≈{params:.3g} parameters; training it needs "
                f"at least ≈{trainer / 2**30:.1f} GiB of GPU memory (fp32 weights, gradients and "
                f"Adam moments), the trainer's GPUs have {gpu_memory / 2**30:.1f} GiB"
            )
        need, what = params * 4, "an fp32 copy while it loads"
    else:
        need = params * BYTES_PER_PARAM
        what = "fp32 weights, gradients, Adam moments and the rollout engine's copy"
    if need > have:
        raise ValueError(
            f"{where}: the model ({shown}) has ≈{params:.3g} parameters; training it needs at "
            f"least ≈{need / 2**30:.1f} GiB of memory ({what}), this machine has "
            f"{have / 2**30:.1f} GiB available"
        )
    return need


def read_safetensors_header(fs, path: str, shown: str) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file, checked: known dtypes, non-negative integer
    shapes, byte spans that match dtype × shape and tile the data exactly to the end of the
    file (a truncated or padded file is refused)."""
    size = fs.size(path)
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{shown}: not a safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(
                f"{shown}: not a safetensors file, or truncated (header of {n} bytes in a file of "
                f"{size})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{shown}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{shown}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{shown}: tensor {name!r} has a malformed header entry") from e
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"{shown}: tensor {name!r} has dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"{shown}: tensor {name!r} has shape {shape!r}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes:
            raise ValueError(
                f"{shown}: tensor {name!r} ({dtype} {shape}) spans bytes {begin}..{end}, "
                f"expected {nbytes} bytes"
            )
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"{shown}: tensor {name!r} starts at byte {begin}, expected {at}")
        at = end
    if 8 + n + at != size:
        raise ValueError(
            f"{shown}: truncated or corrupt: the header describes {8 + n + at} bytes, the file "
            f"has {size}"
        )
    return header


def _weight_files(fs, base: str, shown: str) -> list[str]:
    index = f"{base}/model.safetensors.index.json"
    if fs.exists(index):
        with fs.open(index, "rt") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{shown}/model.safetensors.index.json is malformed") from e
        return [f"{base}/{name}" for name in sorted(set(weight_map.values()))]
    names = [str(p) for p in fs.ls(base, detail=False)]
    found = sorted(p for p in names if p.endswith(".safetensors"))
    if not found and not any(p.endswith(".bin") for p in names):  # torch pickles: not read here
        raise ValueError(f"{shown} holds no weights (no *.safetensors files)")
    return found


def check_model_dir(url: str, cfg: dict, storage_options: dict | None = None) -> None:
    """A model directory's weights, read by header only: each safetensors file well formed and
    complete, the embedding (and lm_head) shaped [vocab_size, hidden_size] and the layer count
    as config.json says."""
    fs, base = url_to_fs(url.rstrip("/"), **(storage_options or {}))
    where = f"model.path {url!r}"
    sizes = check_model_config(cfg, where)
    layers: set[int] = set()
    for path in _weight_files(fs, base, url.rstrip("/")):
        shown = path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
        if not fs.exists(path):
            raise ValueError(f"{where}: weight file {shown} is missing")
        for name, info in read_safetensors_header(fs, path, shown).items():
            want = [sizes["vocab_size"], sizes["hidden_size"]]
            if name in ("model.embed_tokens.weight", "lm_head.weight") and info["shape"] != want:
                raise ValueError(
                    f"{shown}: {name} is {info['shape']}, but config.json says vocab_size "
                    f"{want[0]} and hidden_size {want[1]}"
                )
            m = _LAYER.match(name)
            if m:
                layers.add(int(m.group(1)))
    if layers and max(layers) + 1 != sizes["num_hidden_layers"]:
        raise ValueError(
            f"{where}: the weights hold {max(layers) + 1} layers, config.json says "
            f"num_hidden_layers {sizes['num_hidden_layers']}"
        )
