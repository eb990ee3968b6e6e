"""Where the trainer and the engines run: `train.device` / `rollout.engine_options.device` (auto | cpu | cuda)
→ a torch device, and the process-group backend that goes with it (gloo on CPU, nccl on CUDA)
for trainer ranks and weight-sync groups. Backends and engines ask here instead of testing for
CUDA themselves."""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def check_device(name: str) -> str:
    """`name` if this machine can run it; a clear error (before anything starts) otherwise."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device cuda was asked for, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use cpu or auto"
        )
    return name


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """auto → cuda when available, else cpu. On CUDA a process takes the GPU of its local rank
    (torchrun's LOCAL_RANK), so N ranks on one node use N devices."""
    if isinstance(name, torch.device):
        return name
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def dist_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for collectives on tensors of `device`."""
    return "nccl" if resolve_device(device).type == "cuda" else "gloo"


def bf16_gemms_native(device: torch.device) -> bool:
    """Whether bf16 GEMMs run natively on `device` (CUDA; a CPU whose oneDNN has bf16 kernels)."""
    if device.type != "cpu":
        return True
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
