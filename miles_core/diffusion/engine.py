"""The image engine: rollouts of the image model in the caller's process.

`ImageEngine.rollout(request)` samples every image of a `RolloutRequest` (wire.py) in one batch
with the sampler the trainer scores again (sde.py), from a generator seeded by the request, so a
request and the engine's weights fix the answer. The engine takes new weights the way the text
engines do (engines/protocol.py): named tensors in its process (`update_weights_from_tensor`,
the `tensor` route, all or nothing), a version, a checksum of what generates. The engine server
(server.py) puts the same engine behind HTTP. One call at a time: a load waits for the rollout
in progress and the next rollout waits for the load.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from miles_core.diffusion.model import ImageModel
from miles_core.diffusion.sde import sample, schedule
from miles_core.diffusion.wire import RolloutOutput, RolloutRequest
from miles_core.engines.protocol import TENSOR
from miles_core.weights.checker import weights_checksum


def check_load(own: dict[str, torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Every tensor names one of the model's, with its shape: else ValueError, before any copy."""
    for name, tensor in tensors:
        if name not in own:
            raise ValueError(f"unknown weight {name!r}: this image model has no such tensor")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}; the model's is "
                f"{tuple(own[name].shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"weight {name!r} is {tensor.dtype}; weights are floating point")


class ImageEngine:
    weight_routes = frozenset({TENSOR})
    per_request_seeds = True  # every request samples from its own seed

    def __init__(self, model: ImageModel, threads: int | None = None):
        self.model = model.eval().requires_grad_(False)
        self.threads = threads
        self._version = 0
        self._lock = threading.Lock()
        self._paused = threading.Event()
        self._paused.set()  # set: not paused
        self.stats = {"rollouts": 0, "images": 0}

    # ------------------------------------------------------------------ rollouts
    def rollout(self, request: RolloutRequest) -> RolloutOutput:
        """The request's images (and trajectory); ValueError if it does not fit the model."""
        ids = request.check_for(self.model.image_size, self.model.encode)
        self._paused.wait()
        with self._lock:
            generator = torch.Generator().manual_seed(request.seed)
            images, trajectory = sample(
                self.model,
                ids,
                request.num_inference_steps,
                request.eta,
                request.guidance_scale,
                generator,
            )
            version = self._version
            self.stats["rollouts"] += 1
            self.stats["images"] += len(ids)
        keep = trajectory is not None and request.rollout_return_dit_trajectory
        return RolloutOutput(
            images=images if request.return_images else None,
            latents=trajectory.latents if keep else None,
            sigmas=schedule(self.model.scheduler, request.num_inference_steps),
            log_probs=trajectory.log_probs if trajectory is not None else None,
            weight_version=version,
        )

    # ------------------------------------------------------------------ weights
    @property
    def image_size(self) -> int:
        return self.model.image_size

    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *_: object
    ) -> int:
        """Copies the tensors in by name, all or nothing; returns the bytes copied."""
        tensors = list(named_tensors)
        own = self.named_tensors()
        check_load(own, tensors)
        with self._lock, torch.no_grad():
            for name, tensor in tensors:
                own[name].copy_(tensor)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def weights_checksum(self, scope: str = "all") -> str:
        if scope not in ("all", "base"):
            raise ValueError(f"an image engine has no {scope!r} weights (it serves no adapters)")
        with self._lock:
            return weights_checksum(self.named_tensors().items())

    def pause(self, mode: str = "abort") -> None:
        """New rollouts wait until `resume`; the one in progress finishes (loads wait for it)."""
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    def load_counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._paused.set()
