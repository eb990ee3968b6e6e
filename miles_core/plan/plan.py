"""`miles plan --config FILE --gpus N`: a run config laid out on N GPUs without starting anything.

It reads the model's config.json (`model.path`: a directory with that file is enough), checks the
trainer's layout by Megatron-core's rules (`train.parallel`) and the engines' (their engine kind's
own), counts the GPUs each side needs, estimates memory per GPU (`plan/memory.py`) and places the
processes on bundles (`plan/placement.py`). Every problem found is named at once (`PlanError`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.plan.memory import GB, EngineMemory, TrainerMemory, engine_memory, trainer_memory
from miles_core.plan.placement import Placement, place, rollout_gpus
from miles_core.plan.sizes import ModelSizes, model_sizes
from miles_core.train.backends.megatron.layout import (
    Layout,
    check_buildable,
    fit_problems,
    resolve_layout,
)

DEFAULT_GPU_SHARE = 0.85  # of an engine GPU's memory for weights and KV cache, if not set


class PlanError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the plan does not fit:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Plan:
    model: str
    hf: dict[str, Any]
    sizes: ModelSizes
    layout: Layout
    gpus: int
    seq_len: int
    placement: Placement
    trainer: TrainerMemory
    engine: EngineMemory | None
    offload: str
    gpu_bytes: float
    notes: list[str] = field(default_factory=list)


def _weight_bytes(config) -> float:
    """Bytes per linear weight at the rollout precision, its scales included."""
    from miles_core.precision.format import build_format

    fmt = build_format(config.rollout.precision, config.rollout.precision_options)
    if not fmt.quantizes:
        return 2.0
    shape = (4096, 4096)
    total = sum(math.prod(s) * dtype.itemsize for s, dtype in fmt.parts(shape).values())
    return total / math.prod(shape)


def read_model_config(config) -> tuple[str, dict[str, Any]]:
    if config.model.path is None:
        raise PlanError(["model.path: the plan needs a model directory with a config.json"])
    path = Path(config.model.path) / "config.json"
    if not path.is_file():
        raise PlanError([f"model.path: {path} does not exist"])
    return str(config.model.path), json.loads(path.read_text())


def make_plan(config, gpus: int, seq_len: int | None = None) -> Plan:
    """The plan of `config` on `gpus` GPUs for sequences of `seq_len` tokens (default: the
    rollout's max_new_tokens); raises PlanError naming every constraint it breaks."""
    from miles_core.engines.registry import ENGINES

    problems: list[str] = []
    model, hf = read_model_config(config)
    train, cluster = config.train, config.cluster
    seq_len = seq_len or config.rollout.max_new_tokens
    layout = resolve_layout(train.parallel.model_dump(), train.world_size)
    problems += [f"train.parallel {layout.describe()}: {p}" for p in fit_problems(layout, hf)]
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        problems.append(
            f"train.parallel.cp={layout.cp}: the sequence ({seq_len} tokens) must split into "
            f"2 × cp = {2 * layout.cp} equal chunks (load-balanced context parallelism)"
        )
    unit = train.micro_batch_size * layout.dp
    if train.global_batch_size % unit:
        problems.append(
            f"train.global_batch_size ({train.global_batch_size}) is not a multiple of "
            f"micro_batch_size × dp = {train.micro_batch_size} × {layout.dp}"
        )
    kind = ENGINES.get(config.rollout.engine)
    options = kind.Options.model_validate(config.rollout.engine_options or {})
    g = kind.gpus_per_engine(options)
    problems += [f"rollout.engine_options: {p}" for p in kind.layout_problems(options, hf)]
    need = train.world_size if cluster.colocate else train.world_size + g
    if gpus < need:
        what = "the trainer's ranks" if cluster.colocate else "the trainer's ranks and one engine"
        problems.append(f"--gpus {gpus}: {what} need {need} GPUs")
    elif g and rollout_gpus(gpus, train.world_size, cluster.colocate) % g:
        left = rollout_gpus(gpus, train.world_size, cluster.colocate)
        problems.append(
            f"--gpus {gpus}: the {left} GPUs for rollout do not split into engines of {g} GPUs "
            "(rollout.engine_options)"
        )
    if problems:
        raise PlanError(problems)

    sizes = model_sizes(hf)
    gpu_bytes = (cluster.gpu_memory_gb - cluster.reserved_gb) * GB
    bucket_mb = train.offload.bucket_mb
    trainer = trainer_memory(sizes, hf, layout, seq_len, train.micro_batch_size, bucket_mb)
    offload = train.offload.optimizer
    used = trainer.total if offload == "none" else trainer.total_offloaded
    notes = []
    if used > gpu_bytes:
        fix = (
            " even with the optimizer state offloaded"
            if trainer.total_offloaded > gpu_bytes
            else "; it fits with train.offload.optimizer: cpu or disk"
        )
        problems.append(
            f"trainer: ≈{used / GB:.0f} GB per GPU (stage {trainer.stage}) exceeds "
            f"cluster.gpu_memory_gb ({cluster.gpu_memory_gb:g}) less reserved_gb "
            f"({cluster.reserved_gb:g}){fix}"
        )
    engine = None
    if g:
        share = kind.gpu_share(options) or DEFAULT_GPU_SHARE
        engine = engine_memory(sizes, hf, g, _weight_bytes(config), gpu_bytes, share)
        if engine.kv_tokens < seq_len:
            problems.append(
                f"engine: its weights take ≈{engine.weights / GB:.0f} GB of the "
                f"{share * gpu_bytes / GB:.0f} GB share of each GPU, leaving KV cache for "
                f"{engine.kv_tokens} tokens, fewer than one {seq_len}-token sequence"
            )
    else:
        notes.append(f"rollout.engine {config.rollout.engine!r} runs on CPUs: no GPUs planned")
    if problems:
        raise PlanError(problems)
    try:
        check_buildable(layout)
    except ValueError as e:
        notes.append(f"this version's Megatron trainer does not run this layout yet: {e}")
    placement = place(gpus, train.world_size, g, cluster.colocate, cluster.gpus_per_node)
    return Plan(
        model,
        hf,
        sizes,
        layout,
        gpus,
        seq_len,
        placement,
        trainer,
        engine,
        offload,
        gpu_bytes,
        notes,
    )
