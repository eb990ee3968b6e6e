"""Evaluation of an image run's policy on its own engine, between steps (eval.mode: shared).

Each evaluation samples `diffusion.eval_samples_per_scene` images of every held-out scene with
the deterministic ODE from fixed seeds, so two versions are compared on the same noise, and
logs the checker's mean per attribute as `eval/held_out_<attribute>` (`eval/held_out_all` is
the compositional accuracy, GenEval's measure) and `eval/reward_mean`. It also samples the grid
prompts from a fixed seed and logs the images as one grid per evaluation (`eval_grid`, MLflow's
image log with the version as its step, and `eval_grids/version_<N>.png`): the same prompts and
noise at every version, so the grids show what training changed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from miles_core.diffusion.rollout import Sampling, mean_scores, score_images
from miles_core.diffusion.scenes import Scene

EVAL_SEED = 1_000_003
GRID_SEED = 2_000_003
PAD = 2  # grey pixels between the grid's images
REQUEST_IMAGES = 64


def default_grid(held: list[Scene], train: list[Scene]) -> list[Scene]:
    """Three held-out scenes and three training ones, spread over the lists."""
    return held[:: max(1, len(held) // 3)][:3] + train[:: max(1, len(train) // 3)][:3]


def image_grid(images: torch.Tensor, columns: int) -> np.ndarray:
    """uint8 [H, W, 3]: `images` float [N, 3, S, S] in [-1, 1], `columns` per row."""
    n, _, size, _ = images.shape
    rows = -(-n // columns)
    cell = size + PAD
    grid = np.full((rows * cell + PAD, columns * cell + PAD, 3), 128, dtype=np.uint8)
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    for i, image in enumerate(pixels.numpy()):
        r, c = divmod(i, columns)
        grid[PAD + r * cell : PAD + r * cell + size, PAD + c * cell : PAD + c * cell + size] = image
    return grid


class ImageEvaluation:
    background = False  # on the run's engine, between steps

    def __init__(
        self, config, engine, sampling: Sampling, held: list[Scene], train: list[Scene], tracker
    ):
        d = config.diffusion
        self.config, self.engine, self.sampling, self.tracker = config, engine, sampling, tracker
        self.every = config.eval.every
        self.held = held
        self.samples = d.eval_samples_per_scene
        self.grid = (
            [Scene.parse(p) for p in d.grid_prompts]
            if d.grid_prompts
            else default_grid(held, train)
        )
        self.grid_samples = d.grid_samples
        self._done: list[tuple[int, dict[str, float]]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="miles-grids-"))

    def due(self, version: int) -> bool:
        """The starting policy, every `eval.every` versions, and the last."""
        last = self.config.train.num_steps
        return version in (0, last) or bool(self.every and version % self.every == 0)

    def _images(self, scenes: list[Scene], n: int, seed: int) -> torch.Tensor:
        """`n` ODE samples of each scene, in requests of at most `REQUEST_IMAGES` images (a
        batch past that is slower per image on a CPU)."""
        per = max(1, REQUEST_IMAGES // n)
        return torch.cat(
            [
                self.engine.rollout(
                    self.sampling.request(scenes[i : i + per], n, seed + i, False)
                ).images
                for i in range(0, len(scenes), per)
            ]
        )

    def submit(self, version: int) -> None:
        """Scores policy `version` (the one the engine serves) now, and logs its grid."""
        images = self._images(self.held, self.samples, EVAL_SEED)
        rows = [s for s in self.held for _ in range(self.samples)]
        scores = score_images(images, rows)
        metrics = mean_scores(scores, "eval/held_out_")
        metrics["eval/reward_mean"] = metrics["eval/held_out_reward"]
        grid = self._images(self.grid, self.grid_samples, GRID_SEED)
        self.log_grid(version, image_grid(grid, self.grid_samples))
        self._done.append((version, metrics))

    def log_grid(self, version: int, grid: np.ndarray) -> None:
        if self.tracker is None:
            return
        from PIL import Image

        path = self._dir / f"version_{version:06d}.png"
        Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(
            path
        )
        client, run_id = self.tracker.client, self.tracker.run_id
        client.log_artifact(run_id, str(path), artifact_path="eval_grids")
        client.log_image(run_id, grid, key="eval_grid", step=version)

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)
