"""Reshardable distributed checkpoints of the Megatron backend (megatron-core's
`dist_checkpointing`, torch_dist format): every rank writes the model and optimizer shards it
holds under global keys (layer offsets and tensor-parallel slices recorded), so a checkpoint saved
with one tp/pp layout loads into another. Saved beside the HF export of the same weights
(`backend.py`), in `<checkpoint>/megatron/`.

The optimizer is torch's AdamW on Megatron's gradient buffers: its moments (`exp_avg`,
`exp_avg_sq`) are saved as sharded tensors keyed like their parameters (so they reshard with
them); the step count and the learning rates, the same for every parameter, travel as plain
values (`trainer_state.json` holds the LR schedule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _sharded(backend) -> dict[str, Any]:
    """The sharded state dict of this rank: the model's, and the optimizer's moments keyed
    after the parameter each belongs to."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = backend.model.sharded_state_dict()
    by_param = {
        id(backend.model.get_parameter(k)): v
        for k, v in model_sd.items()
        if _is_param(backend.model, k)
    }
    optim: dict[str, Any] = {}
    for i, p in enumerate(backend.params):
        state = _state(backend.optimizer, p)
        for moment in MOMENTS:
            optim[f"{i}.{moment}"] = make_sharded_optimizer_tensor(
                by_param[id(p)], state[moment], f"optimizer.{moment}"
            )
    return {"model": model_sd, "optimizer": optim}


def _is_param(model, key: str) -> bool:
    try:
        model.get_parameter(key)
    except AttributeError:
        return False
    return True


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `p`, created (zero moments, step 0) before its first step, so a
    template for loading has every tensor."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        for moment in MOMENTS:
            state[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _in_process_results() -> None:
    """megatron-core's file writer collects its writers' results through a queue it creates on
    first use with a spawned `multiprocessing.Manager`: a server process that re-imports the
    main module (a script without a main guard runs again) and outlives the save. Saving
    synchronously, the writer puts and reads the results in this process: a plain queue is
    what it needs (set once, before the first save)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(backend, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    _in_process_results()
    directory.mkdir(parents=True, exist_ok=True)
    sd = _sharded(backend)
    sd["common"] = {
        "step": float(_state(backend.optimizer, backend.params[0])["step"]),
        "lrs": [g["lr"] for g in backend.optimizer.param_groups],
        "layout": backend.layout.__dict__,
    }
    dist_checkpointing.save(sd, str(directory))


def load(backend, directory: Path) -> dict[str, Any]:
    """Loads the model and optimizer shards of this rank's layout (resharding as needed);
    returns the common values (the layout it was saved with among them)."""
    from megatron.core import dist_checkpointing

    sd = _sharded(backend)
    sd["common"] = {}
    loaded = dist_checkpointing.load(sd, str(directory))
    result = backend.model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{directory}: the checkpoint lacks {missing[:5]}")
    common = loaded["common"]
    for i, p in enumerate(backend.params):
        state = _state(backend.optimizer, p)
        for moment in MOMENTS:
            state[moment].copy_(loaded["optimizer"][f"{i}.{moment}"])
        state["step"] = torch.tensor(float(common["step"]))
    for group, lr in zip(backend.optimizer.param_groups, common["lrs"], strict=True):
        group["lr"] = lr
    return common
