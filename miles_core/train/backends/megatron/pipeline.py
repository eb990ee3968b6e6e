"""The pipeline schedule of the Megatron backend: every micro-batch forward through the stages,
then every micro-batch backward (GPipe order), activations and their gradients passed between
neighbouring stages with point-to-point sends on the pipeline group (gloo on CPU, nccl on CUDA).

megatron-core 0.16.1 has 1F1B schedules (`pipeline_parallel.schedules`), but they allocate
counters with `device="cuda"` and synchronise CUDA between sends, so they do not run on CPU;
this one holds every micro-batch's activations until the backward (1F1B keeps at most `pp`),
which is what a CPU-sized model affords. The stages exchange the shape of each activation first,
so micro-batches may differ in rows and length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Stage:
    """This rank's place in its pipeline: the group, its neighbours' global ranks."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.group = ps.get_pipeline_model_parallel_group()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.prev = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if self.last else ps.get_pipeline_model_parallel_next_rank()

    def send(self, t: torch.Tensor, dst: int) -> None:
        shape = torch.tensor(list(t.shape) + [0] * (4 - t.dim()), dtype=torch.int64)
        dist.send(shape.to(t.device), dst, group=self.group)
        dist.send(t.contiguous(), dst, group=self.group)

    def recv(self, src: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shape = torch.zeros(4, dtype=torch.int64, device=device)
        dist.recv(shape, src, group=self.group)
        dims = [int(d) for d in shape.tolist() if d > 0]
        out = torch.empty(dims, dtype=dtype, device=device)
        dist.recv(out, src, group=self.group)
        return out


def run_pipeline(
    stage: Stage,
    model: Any,  # the stage's module (what `set_input_tensor` is called on)
    forward: Callable[[int], torch.Tensor],  # micro-batch i → this stage's output
    on_last: Callable[[int, torch.Tensor], torch.Tensor | None],  # logits → loss (last stage)
    count: int,
    train: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Runs `count` micro-batches through the pipeline; backward when `train`."""
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor | None] = []
    for i in range(count):
        x = None
        if not stage.first:
            x = stage.recv(stage.prev, dtype, device).requires_grad_(train)
            model.set_input_tensor(x)
        y = forward(i)
        if stage.last:
            loss = on_last(i, y)
            outputs.append(loss)
        else:
            stage.send(y.detach(), stage.next)
            outputs.append(y)
        inputs.append(x)
    if not train:
        return
    for i in range(count):
        y, x = outputs[i], inputs[i]
        if stage.last:
            if y is not None:
                y.backward()
        else:
            grad = stage.recv(stage.next, dtype, device)
            torch.autograd.backward(y, grad)
        if not stage.first:
            assert x is not None
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            stage.send(g, stage.prev)
        outputs[i] = inputs[i] = None  # free the activations as their backward ends
