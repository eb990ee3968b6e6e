"""AdamW whose state lives off the trainer's device between steps (`train.offload.optimizer`).

`cpu` keeps each parameter's state (`step`, `exp_avg`, `exp_avg_sq`) in host memory, `disk` in one
safetensors file per bucket under a directory. `step()` streams the state in bucket by bucket:
read → the same AdamW step over that bucket's parameters → write back → drop. AdamW is
element-wise given a parameter's gradient, state, step count and its group's lr and weight
decay; gradient clipping happens before `step()` over every parameter, and each bucket steps
with its group's current settings, so the result is bitwise the resident optimizer's. Storage
is float32 whatever the parameter dtype (exact for bf16 and fp32 state).

Checkpoints read the state through `materialized()`: inside it every parameter's state is in
`optimizer.state` as with a resident AdamW, so a backend's save and load code is unchanged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MODES = ("none", "cpu", "disk")
KEYS = ("step", "exp_avg", "exp_avg_sq")


class HostStore:
    """Bucket states in host memory (pinned when CUDA is there, for the copies back)."""

    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, torch.Tensor]] = {}

    def write(self, bucket: int, tensors: dict[str, torch.Tensor]) -> None:
        self._buckets[bucket] = tensors

    def read(self, bucket: int) -> dict[str, torch.Tensor]:
        return self._buckets.get(bucket, {})

    def resident_bytes(self) -> int:
        return sum(t.nbytes for b in self._buckets.values() for t in b.values())

    def close(self) -> None:
        self._buckets.clear()


class DiskStore:
    """Bucket states as safetensors files in a directory of their own (made under `root`),
    removed when the store is closed or collected."""

    def __init__(self, root: str | None) -> None:
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="miles-optimizer-", dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def _file(self, bucket: int) -> Path:
        return self.directory / f"bucket-{bucket:05d}.safetensors"

    def write(self, bucket: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tmp = self._file(bucket).with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self._file(bucket))  # a crash mid-write leaves the old bucket whole

    def read(self, bucket: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self._file(bucket)
        return load_file(str(path)) if path.exists() else {}

    def resident_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._cleanup()


class OffloadedAdamW(torch.optim.AdamW):
    """torch's AdamW with its state in `store` between steps, stepped `bucket_numel` parameter
    elements at a time (a parameter larger than that is a bucket of its own)."""

    def __init__(self, params, *, store: HostStore | DiskStore, bucket_numel: int, **kwargs):
        super().__init__(params, **kwargs)
        self.store = store
        self.bucket_numel = int(bucket_numel)
        self._resident = False
        # how to rebuild each stored tensor: its dtype, device and DTensor layout (or None)
        self._layout: dict[tuple[int, str], tuple[torch.dtype, torch.device, Any]] = {}

    def _buckets(self) -> list[list[tuple[int, int, torch.Tensor]]]:
        """(group index, parameter index, parameter) in bucket order: the groups' order."""
        buckets: list[list[tuple[int, int, torch.Tensor]]] = [[]]
        filled, index = 0, 0
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if buckets[-1] and filled + p.numel() > self.bucket_numel:
                    buckets.append([])
                    filled = 0
                buckets[-1].append((g, index, p))
                filled += p.numel()
                index += 1
        return buckets

    def _bring(self, b: int, bucket: list[tuple[int, int, torch.Tensor]]) -> None:
        stored = self.store.read(b)
        for _, i, p in bucket:
            if f"{i}.step" not in stored:
                continue  # no state yet: AdamW makes it on this parameter's first step
            self.state[p] = {k: self._restore(i, k, stored[f"{i}.{k}"]) for k in KEYS}

    def _put_away(self, b: int, bucket: list[tuple[int, int, torch.Tensor]]) -> None:
        out: dict[str, torch.Tensor] = {}
        for _, i, p in bucket:
            state = self.state.pop(p, None)
            if not state:
                continue
            for k in KEYS:
                out[f"{i}.{k}"] = self._to_storage(i, k, state[k])
        if out:
            self.store.write(b, out)

    def _to_storage(self, i: int, key: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        layout = None
        if isinstance(t, DTensor):
            layout = (t.device_mesh, t.placements, t.shape, t.stride())
            t = t.to_local()
        self._layout[(i, key)] = (t.dtype, t.device, layout)
        t = t.detach().to("cpu", torch.float32).contiguous()
        if isinstance(self.store, HostStore) and torch.cuda.is_available():
            t = t.pin_memory()
        return t

    def _restore(self, i: int, key: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        dtype, device, layout = self._layout[(i, key)]
        t = t.to(device=device, dtype=dtype, non_blocking=True)
        if layout is not None:
            mesh, placements, shape, stride = layout
            t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
        return t

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the offloaded AdamW takes no closure")
        if self._resident:
            return super().step()
        groups = self.param_groups
        try:
            for b, bucket in enumerate(self._buckets()):
                self._bring(b, bucket)
                # the bucket's parameters, each group with its current lr and weight decay
                self.param_groups = [
                    {**group, "params": [p for g2, _, p in bucket if g2 == g]}
                    for g, group in enumerate(groups)
                    if any(g2 == g for g2, _, _ in bucket)
                ]
                super().step()
                self.param_groups = groups
                self._put_away(b, bucket)
        finally:
            self.param_groups = groups
        return None

    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Every parameter's state in `self.state`, as a resident AdamW holds it (checkpoints
        save and load through it); written back to the store on exit."""
        buckets = self._buckets()
        for b, bucket in enumerate(buckets):
            self._bring(b, bucket)
        self._resident = True
        try:
            yield
        finally:
            self._resident = False
            for b, bucket in enumerate(buckets):
                self._put_away(b, bucket)

    def state_dict(self) -> dict[str, Any]:
        if self._resident:
            return super().state_dict()
        with self.materialized():
            return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.materialized():
            super().load_state_dict(state_dict)

    def resident_state_bytes(self) -> int:
        """Bytes of optimizer state held in memory between steps (the host store's)."""
        return self.store.resident_bytes()

    def close(self) -> None:
        self.store.close()


def offload_settings(optim: dict[str, Any]) -> dict[str, Any]:
    """`train.offload` of a config section's settings (none when it has none)."""
    return dict(optim.get("offload") or {"optimizer": "none"})


def make_store(settings: dict[str, Any]) -> HostStore | DiskStore:
    mode = settings.get("optimizer", "none")
    if mode == "cpu":
        return HostStore()
    if mode == "disk":
        return DiskStore(settings.get("dir"))
    raise ValueError(f"train.offload.optimizer must be one of {MODES[1:]} here, not {mode!r}")


@contextmanager
def materialized(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """An offloaded optimizer's state brought into memory for a checkpoint; nothing for a
    resident one."""
    if isinstance(optimizer, OffloadedAdamW):
        with optimizer.materialized():
            yield
    else:
        yield
