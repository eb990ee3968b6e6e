"""`none`: the engine serves the trainer's weights as they are (float32, or rounded to
weight_sync.dtype)."""

from __future__ import annotations

from miles_core.precision.format import FORMATS, WeightFormat


@FORMATS.register("none")
class NoFormat(WeightFormat):
    quantizes = False
