"""An image run's inputs, checked before anything starts (run/preflight.py calls it): the
starting model is one (a preset, or a directory holding an image model of the scenes'
vocabulary), and the configured resolution is the model's."""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.config import RunConfig
from miles_core.diffusion.model import PRESETS, check_image_model_dir
from miles_core.diffusion.scenes import VOCABULARY


def check_image_run(config: RunConfig, resume: bool = False) -> None:
    d = config.diffusion
    assert d is not None
    if d.model in PRESETS:
        size = PRESETS[d.model].image_size
    else:
        directory = Path(d.model)
        if "://" in d.model or not directory.is_dir():
            raise FileNotFoundError(
                f"diffusion.model {d.model!r} is neither a preset ({' | '.join(PRESETS)}) nor "
                "a local image model directory"
            )
        index = check_image_model_dir(directory)
        words = json.loads((directory / "vocabulary.json").read_text())
        if tuple(words) != VOCABULARY:
            raise ValueError(
                f"diffusion.model {d.model}: its vocabulary is not the scenes' "
                "(miles_core/diffusion/scenes.py: VOCABULARY)"
            )
        size = int(index["image_size"])
    if d.resolution is not None and d.resolution != size:
        raise ValueError(
            f"diffusion.resolution {d.resolution}: diffusion.model {d.model} makes "
            f"{size}×{size} images"
        )
