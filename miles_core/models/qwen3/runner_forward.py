"""The embedded engine's fast path for Qwen3 models: its `BatchForward` on the serving engine's
lean forward (`runner.py`), through the slot-cache `BatchForward` of `engines/cpu/slot_forward.py`.
The runner's packed weights are rebuilt lazily after `invalidate`."""

from __future__ import annotations

import torch

from miles_core.engines.cpu.batch_forward import ForwardUnsupported
from miles_core.engines.cpu.slot_forward import SlotBatchForward
from miles_core.models.family import runner_refuses
from miles_core.models.qwen3.runner import Qwen3Runner


class RunnerForward(SlotBatchForward):
    def __init__(self, model: torch.nn.Module):
        reason = runner_refuses(model.config)
        if reason is not None:
            raise ForwardUnsupported(reason)
        super().__init__(Qwen3Runner(model, slots=0))
