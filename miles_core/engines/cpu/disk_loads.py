"""The engine server's disk loads (`/update_weights_from_disk`): confined to the server's weight
roots, bounded in bytes, and run on a small pool of their own with a timeout.

Reads block (a slow store, a large file), so they never run on the event loop nor on the
default executor that control routes (`/pause_generation`, `/abort_request`, `/flush_cache`)
use: a load that hangs holds one of this pool's threads, never theirs. Past `workers` loads in
flight the next is answered 429; a load past `timeout_s` is answered 408 and what it reads
later is dropped (the engine keeps its weights and version).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence

import torch

from miles_core.processes.roots import AllowedRoots, RootRefusal
from miles_core.weights.transports.disk import (
    WeightLoadError,
    WeightsNotFound,
    confine,
    load_weight_dir,
)

LOAD_TIMEOUT_S = 600.0
LOAD_WORKERS = 2
HEADER_SLACK = 16 << 20  # safetensors headers and manifest beside the tensors' bytes


class DiskLoadRefused(Exception):
    """A disk load answered with `status` and `message` (the engine changed nothing)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def max_load_bytes(params: dict[str, torch.Tensor]) -> int:
    """The most bytes a load may read: every parameter in the widest dtype a push may carry
    (8 bytes an element), plus headers. A larger file cannot be weights for this model."""
    return sum(p.numel() for p in params.values()) * 8 + HEADER_SLACK


class DiskLoader:
    def __init__(
        self,
        roots: Sequence[str] | AllowedRoots = (),
        timeout_s: float = LOAD_TIMEOUT_S,
        workers: int = LOAD_WORKERS,
    ):
        self.roots = (
            roots if isinstance(roots, AllowedRoots) else AllowedRoots.parse(roots, "weight root")
        )
        self.timeout_s = timeout_s
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="miles-disk-load"
        )
        self._busy = 0
        self._lock = threading.Lock()

    async def load(
        self, path: str, current: dict[str, torch.Tensor], current_version: int
    ) -> dict[str, torch.Tensor]:
        """The tensors at `path` (checked against its manifest), or DiskLoadRefused."""
        try:  # lexical and real-path checks first: nothing outside the roots is touched
            confine(self.roots, path)
        except RootRefusal as e:
            raise DiskLoadRefused(e.status, str(e)) from None
        with self._lock:
            if self._busy >= self.workers:
                raise DiskLoadRefused(
                    429, f"{self._busy} weight loads are in progress; retry after they finish"
                )
            self._busy += 1
        future = self._pool.submit(self._read, path, current, current_version)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise DiskLoadRefused(
                408, f"loading {path!r} took longer than {self.timeout_s:g} s; nothing changed"
            ) from None

    def _done(self, _future) -> None:
        with self._lock:
            self._busy -= 1

    def _read(self, path, current, current_version) -> dict[str, torch.Tensor]:
        try:
            return load_weight_dir(
                path,
                None,
                current,
                current_version,
                roots=self.roots,
                max_bytes=max_load_bytes(current),
            )
        except RootRefusal as e:
            raise DiskLoadRefused(e.status, str(e)) from None
        except WeightsNotFound as e:  # missing, unreadable or not a regular file: one answer
            raise DiskLoadRefused(403, str(e)) from None
        except (WeightLoadError, ValueError) as e:  # not safetensors, corrupt, unreachable
            raise DiskLoadRefused(400, str(e)) from None
        except OSError as e:
            raise DiskLoadRefused(400, f"cannot read weights at {path!r}: {e.strerror}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
