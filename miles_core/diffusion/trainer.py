"""The image trainer: an image model under FSDP2, trained by an image loss (loss.py).

`train_step(rollout, seed)` trains on one rollout's images: it splits the rows into
`optimizer_steps` mini-batches (one optimizer step each) and those into micro-batches of
`micro_batch_size` rows, and calls the loss once per micro-batch and pass, each pass's loss
divided by its mini-batch's (sample, trained step) pairs and backpropagated at once. Which
steps of a trajectory a row trains (Flow-GRPO) and the noise of DiffusionNFT are drawn from
`seed`, so a step is reproducible. `train/log_prob_mean_abs_diff` is measured over the first
mini-batch, before the first optimizer step: the trainer's recomputed log-probs against the
engine's, which are equal bit for bit (the same fp32 step code, diffusion/sde.py).

The model is `fully_shard`ed per denoiser block and at the root when it has several ranks or a
GPU (`shard`), in fp32 like the engine; one CPU rank trains the plain module, whose AdamW
steps are the same. Weights leave as full tensors by name (`named_weights`, the weight
transports' contract) and a checkpoint is an image model directory plus the optimizer's state.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from miles_core.device import resolve_device
from miles_core.diffusion.loss import ImageMicroBatch, ImageModels
from miles_core.diffusion.model import ImageModel, load_image_model, save_image_model
from miles_core.diffusion.rollout import ImageRollout
from miles_core.train import distributed as spmd
from miles_core.train.loss import LOSSES
from miles_core.train.lr_schedule import build_optimizer
from miles_core.train.optimizer_offload import materialized
from miles_core.weights.checker import weights_checksum
from miles_core.weights.source import Bucket, full_tensor_buckets

OLD_POLICY_FILE = "old_policy.safetensors"


class ImageTrainer:
    world: int

    def __init__(
        self,
        model_dir: str | Path,
        optim: dict[str, Any],
        loss: str,
        loss_options: dict[str, Any] | None = None,
        total_steps: int = 1,
        seed: int = 0,
        device: str = "cpu",
        shard: bool | None = None,
    ):
        self.device = resolve_device(device)
        self.rank, self.world = spmd.init_distributed(self.device)
        if self.world > 1:
            raise ValueError(
                "the image trainer runs one rank (several ranks need the follower replay the "
                "text backends have): set train.world_size: 1"
            )
        if optim.get("threads"):
            torch.set_num_threads(int(optim["threads"]))
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.loss = LOSSES.get(loss)
        self.loss_cfg = self.loss.config(loss_options or {})
        self.needs = self.loss.needs(self.loss_cfg)
        model = load_image_model(model_dir).to(self.device)
        frozen = lambda: copy.deepcopy(model).eval().requires_grad_(False)  # noqa: E731
        self.reference = frozen() if self.needs.reference else None
        self.old = frozen() if self.needs.old_policy else None
        self.sharded = (self.world > 1 or self.device.type == "cuda") if shard is None else shard
        if self.sharded:  # fp32 parameters and compute, as the engine samples
            mesh = init_device_mesh(self.device.type, (self.world,))
            for block in model.blocks():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model: ImageModel = model
        self.optimizer, self.scheduler = build_optimizer(model.parameters(), optim, total_steps)
        self.grad_clip = float(optim["grad_clip"])
        self.micro_batch_size = int(optim["micro_batch_size"])

    # ------------------------------------------------------------------ training
    def train_step(
        self, rollout: ImageRollout, optimizer_steps: int = 1, seed: int = 0
    ) -> dict[str, float]:
        """One rollout's optimizer steps; the step's metrics (`train/...`)."""
        rows = len(rollout.ids)
        if rows % optimizer_steps or (rows // optimizer_steps) % self.micro_batch_size:
            raise ValueError(
                f"{rows} rows do not split into {optimizer_steps} optimizer steps of whole "
                f"micro-batches of {self.micro_batch_size}"
            )
        batch = self._batch(rollout, seed)
        trained = 1 if batch.steps is None else batch.steps.shape[1]
        passes = self.loss.passes(self.loss_cfg, trained)
        models = ImageModels(
            policy=self.model.velocity,
            reference=self.reference.velocity if self.reference is not None else None,
            old=self.old.velocity if self.old is not None else None,
        )
        per_step = rows // optimizer_steps
        sums: dict[str, float] = {}
        first: dict[str, float] = {}
        norms, lrs = [], []
        self.model.train()
        for m in range(optimizer_steps):
            denom = float(per_step * trained)
            step_sums: dict[str, float] = {}
            for start in range(m * per_step, (m + 1) * per_step, self.micro_batch_size):
                mb = _rows(batch, start, start + self.micro_batch_size)
                for k in range(passes):
                    loss, stats = self.loss(models, mb, k, self.loss_cfg, denom)
                    loss.backward()
                    for name, value in stats.items():
                        step_sums[name] = step_sums.get(name, 0.0) + value
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            lrs.append(self.optimizer.param_groups[0]["lr"])
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self._update_old()
            if m == 0:
                first = dict(step_sums)
            for name, value in step_sums.items():
                sums[name] = sums.get(name, 0.0) + value
        self.model.eval()
        pairs = float(rows * trained)
        metrics = {
            f"train/{n.lstrip('_')}": v / pairs if n.startswith("_") else v for n, v in sums.items()
        }
        if "_log_prob_mean_abs_diff" in first:  # before the first optimizer step only
            metrics["train/log_prob_mean_abs_diff"] = first["_log_prob_mean_abs_diff"] / (
                per_step * trained
            )
        metrics["train/grad_norm"] = sum(norms) / len(norms)
        metrics["train/lr"] = lrs[0]
        metrics["train/optimizer_steps"] = float(optimizer_steps)
        return metrics

    def _batch(self, rollout: ImageRollout, seed: int) -> ImageMicroBatch:
        """The rollout as one batch on the device, with the rows' trained steps (or noise)."""
        generator = torch.Generator().manual_seed(seed)
        rows = len(rollout.ids)
        sampling_steps = len(rollout.sigmas) - 1
        trained = self.loss.trained_steps(self.loss_cfg, sampling_steps)
        steps = noise_levels = noise = None
        if self.needs.trajectory:
            if rollout.latents is None or rollout.log_probs is None:
                raise ValueError(
                    f"loss {type(self.loss).__name__} trains on trajectories: the rollout has none "
                    "(sample with the SDE, noise level > 0)"
                )
            if getattr(self.loss_cfg, "timesteps", "random") == "first":
                steps = torch.arange(trained).expand(rows, trained).clone()
            else:
                steps = torch.stack(
                    [
                        torch.randperm(sampling_steps, generator=generator)[:trained]
                        for _ in range(rows)
                    ]
                )
        else:  # a noise level from the schedule (σ > 0) and fresh noise per row
            levels = rollout.sigmas[:-1]
            pick = torch.randint(len(levels), (rows,), generator=generator)
            noise_levels = levels[pick]
            noise = torch.randn(rollout.images.shape, generator=generator)
        d = self.device

        def on(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(d)

        return ImageMicroBatch(
            ids=rollout.ids.to(d),
            advantages=rollout.advantages.to(d, torch.float32),
            images=rollout.images.to(d),
            sigmas=rollout.sigmas.to(d),
            guidance=rollout.guidance,
            eta=rollout.eta,
            latents=on(rollout.latents),
            old_log_probs=on(rollout.log_probs),
            steps=on(steps),
            noise_levels=on(noise_levels),
            noise=on(noise),
        )

    @torch.no_grad()
    def _update_old(self) -> None:
        """DiffusionNFT's old policy trails the current one: old ← d·old + (1 − d)·θ."""
        if self.old is None:
            return
        decay = float(self.loss_cfg.old_decay)
        current = dict(self.named_parameters())
        for name, param in self.old.named_parameters():
            param.lerp_(current[name].to(param.device), 1 - decay)

    # ------------------------------------------------------------------ how weights leave
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter as a full tensor, by name (gathered when sharded)."""
        for bucket in self.named_weights(1 << 62):
            yield from bucket

    def named_weights(self, bucket_bytes: int = 64 << 20, dtype=None) -> Iterator[Bucket]:
        return full_tensor_buckets(
            list(self.model.named_parameters()), self.rank, bucket_bytes, dtype
        )

    def shard_plan(self, dtype=None, precision=None):
        raise TypeError(
            "the image trainer pushes full tensors: use colocated, shared_memory or disk"
        )

    def join_group(self, group: dict) -> None:
        self.shard_plan()

    def send_shards(self, engine_ranks, dtype=None, precision=None) -> int:
        self.shard_plan()
        return 0

    def weights_checksum(self) -> str:
        return weights_checksum(self.named_parameters())

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> Path:
        """The policy as an image model directory, the optimizer and LR schedule beside it,
        and DiffusionNFT's old policy."""
        path = Path(directory)
        plain = self._plain_copy()
        save_image_model(plain, path)
        if self.old is not None:
            state = {n: p.detach().contiguous() for n, p in self.old.named_parameters()}
            save_file(state, path / OLD_POLICY_FILE)
        with materialized(self.optimizer):
            osd = get_optimizer_state_dict(self.model, self.optimizer)
            dcp.save({"optimizer": osd}, checkpoint_id=str(path / "optimizer"))
        (path / "trainer_state.json").write_text(
            json.dumps({"scheduler": self.scheduler.state_dict()}) + "\n"
        )
        return path

    def load(self, directory: str | Path) -> None:
        path = Path(directory)
        saved = load_image_model(path)
        set_model_state_dict(
            self.model,
            dict(saved.state_dict()),
            options=StateDictOptions(full_state_dict=True),
        )
        if self.old is not None:
            self.old.load_state_dict(load_file(path / OLD_POLICY_FILE), strict=False)
        with materialized(self.optimizer):
            osd = get_optimizer_state_dict(self.model, self.optimizer)
            # parameters that never had a gradient (the null prompt, when guidance is detached
            # in training) have no AdamW state in the checkpoint; they keep the fresh one
            planner = DefaultLoadPlanner(allow_partial_load=True)
            dcp.load({"optimizer": osd}, checkpoint_id=str(path / "optimizer"), planner=planner)
            set_optimizer_state_dict(self.model, self.optimizer, osd)
        state = json.loads((path / "trainer_state.json").read_text())
        self.scheduler.load_state_dict(state["scheduler"])

    def _plain_copy(self) -> ImageModel:
        """The policy as an unsharded model (itself, when it is not sharded)."""
        if not self.sharded:
            return self.model
        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        plain = load_image_model(self.model_dir)
        plain.load_state_dict(sd)
        return plain

    def close(self) -> None:
        pass


def _rows(batch: ImageMicroBatch, start: int, end: int) -> ImageMicroBatch:
    """Rows [start, end) of a batch."""

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    return ImageMicroBatch(
        ids=batch.ids[start:end],
        advantages=batch.advantages[start:end],
        images=batch.images[start:end],
        sigmas=batch.sigmas,
        guidance=batch.guidance,
        eta=batch.eta,
        latents=cut(batch.latents),
        old_log_probs=cut(batch.old_log_probs),
        steps=cut(batch.steps),
        noise_levels=cut(batch.noise_levels),
        noise=cut(batch.noise),
    )
