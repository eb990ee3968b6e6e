"""How many CPU threads one engine step runs its ops on.

A decode step at a small model is a few hundred tiny ops. Splitting each across OpenMP threads
costs a fork/join per op, and when another process holds a core (the Prefect API server, the
trainer of a run on the same machine) every parallel op waits for the thread that lost its core.
Measured in `miles train` flows on 2 cores (4×8 samples, 32 new tokens, runs interleaved): at
the tiny preset, step 0.134–0.163 s with every engine step on one thread against 0.199–0.205 s
on two (three runs each); at the small preset two threads decode faster (generate 0.315–0.317
against 0.337–0.355 s per rollout, two runs each). A step runs on one thread when its largest
GEMM is below `PARALLEL_MIN_MACS` multiply-adds (new tokens × hidden × intermediate size: tiny
decode of 32 rows 0.39 M, small decode 8.4 M, tiny prefill of 32 prompts ≈9 M), else on all of
the process's threads.

The choice is a pure function of the step's token count and the model's shape, so a run replays
with the same thread counts (ops may round differently on one thread than on two, ~1e-7).
`torch.set_num_threads` is process-wide: only an engine that owns the process's compute between
its steps adapts it (a sync run's in-process engine inside `generate`, the engine server's main
scheduler), never an engine whose steps overlap a trainer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

PARALLEL_MIN_MACS = 4_000_000


class StepThreads:
    """The intra-op thread count of each engine step of one model (`enabled=False`: never
    changes it)."""

    def __init__(self, config, enabled: bool, max_threads: int | None = None):
        self.width = int(config.hidden_size) * int(config.intermediate_size)
        self.enabled = enabled
        self.max_threads = max_threads or torch.get_num_threads()

    def count(self, tokens: int) -> int:
        """1 below PARALLEL_MIN_MACS, else max_threads."""
        return 1 if tokens * self.width < PARALLEL_MIN_MACS else self.max_threads

    def around(self, tokens: int) -> AbstractContextManager[None]:
        """The block (a step of `tokens` new tokens) on `count(tokens)` threads."""
        if not self.enabled:
            return contextlib.nullcontext()
        return intra_op_threads(self.count(tokens))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Runs the block on `n` intra-op threads, then restores the previous count."""
    previous = torch.get_num_threads()
    if n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
