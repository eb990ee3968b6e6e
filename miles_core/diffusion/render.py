"""The reference renderer: a scene drawn as a float32 image [3, size, size] in [-1, 1].

The background is black (-1). `count` objects of the scene's colour and shape, each `size/5` to
`size/4` pixels across (rounded inwards, drawn per object), lie wholly inside the named half of
the image with at least `GAP` empty pixels between any two. Squares are filled, circles are
filled discs, triangles are filled isosceles triangles pointing up (base and height equal). A
pixel belongs to a disc or triangle when its centre lies inside the ideal shape.
"""

from __future__ import annotations

import math

import numpy as np

from miles_core.diffusion.scenes import PALETTE, Scene

GAP = 1  # empty pixels between objects: they never touch, so each is one connected component
MAX_COUNT = 3
MIN_OBJECT = 5  # the smallest side drawn: below it, discs and triangles are hard to tell apart
_TRIES = 200  # random layouts tried before the stacked fallback


def object_sizes(size: int) -> tuple[int, int]:
    """The smallest and largest object side for an image `size` pixels across."""
    return math.ceil(size / 5), size // 4


def _fits(size: int) -> bool:
    """Three of the largest objects fit, with gaps, in a half of the image; and the smallest
    is at least MIN_OBJECT pixels across."""
    lo, hi = object_sizes(size)
    return (
        lo >= MIN_OBJECT
        and lo <= hi
        and hi <= size // 2
        and MAX_COUNT * hi + (MAX_COUNT - 1) * GAP <= size
    )


# the smallest image size that fits, as every larger one does
MIN_SIZE = next(n for n in range(1, 1000) if all(_fits(m) for m in range(n, n + 100)))


def _check_size(size: int) -> None:
    if size < MIN_SIZE:
        raise ValueError(
            f"image size {size} is too small to fit {MAX_COUNT} legible objects (at least "
            f"{MIN_OBJECT} px across, {GAP} px apart) in half of the image: use size >= {MIN_SIZE}"
        )


def shape_mask(shape: str, side: int) -> np.ndarray:
    """A boolean [side, side] mask of one object, the shape touching all four sides (the
    triangle's apex row may be empty where no pixel centre lies inside it)."""
    y, x = np.mgrid[0:side, 0:side] + 0.5  # pixel centres
    half = side / 2
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "circle":
        return (x - half) ** 2 + (y - half) ** 2 <= half**2
    if shape == "triangle":  # apex at the top centre, base along the bottom edge
        return np.abs(x - half) <= y / 2
    raise ValueError(f"unknown shape {shape!r}")


def half_bounds(position: str, size: int) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1), end exclusive: the pixels of the named half."""
    lo, hi = size // 2, size - size // 2  # an odd size's middle row/column is in neither
    return {
        "left": (0, size, 0, lo),
        "right": (0, size, hi, size),
        "top": (0, lo, 0, size),
        "bottom": (hi, size, 0, size),
    }[position]


def _apart(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether two boxes (row, col, side) have at least GAP empty pixels between them."""
    (ra, ca, sa), (rb, cb, sb) = a, b
    return ra + sa + GAP <= rb or rb + sb + GAP <= ra or ca + sa + GAP <= cb or cb + sb + GAP <= ca


def _layout(
    sides: list[int], bounds: tuple[int, int, int, int], rng: np.random.Generator
) -> list[tuple[int, int, int]]:
    """Boxes (row, col, side) inside `bounds`, pairwise apart: random tries, then stacked GAP
    apart along the half's long side (always fits: `_check_size`)."""
    r0, r1, c0, c1 = bounds
    for _ in range(_TRIES):
        boxes = []
        for side in sides:
            box = (int(rng.integers(r0, r1 - side + 1)), int(rng.integers(c0, c1 - side + 1)), side)
            if not all(_apart(box, other) for other in boxes):
                break
            boxes.append(box)
        else:
            return boxes
    tall = r1 - r0 >= c1 - c0
    boxes, at = [], r0 if tall else c0
    for side in sides:
        across = (c0 + c1 - side) // 2 if tall else (r0 + r1 - side) // 2
        boxes.append((at, across, side) if tall else (across, at, side))
        at += side + GAP
    return boxes


def render(scene: Scene, size: int = 32, rng: np.random.Generator | int = 0) -> np.ndarray:
    """The scene as float32 [3, size, size] in [-1, 1]; `rng` is a Generator or a seed (the same
    seed gives the same image)."""
    _check_size(size)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    lo, hi = object_sizes(size)
    sides = [int(side) for side in rng.integers(lo, hi + 1, size=scene.count)]
    boxes = _layout(sides, half_bounds(scene.position, size), rng)
    image = np.full((3, size, size), -1.0, dtype=np.float32)
    colour = np.asarray(PALETTE[scene.colour], dtype=np.float32)[:, None] * 2 - 1
    for row, col, side in boxes:
        mask = shape_mask(scene.shape, side)
        image[:, row : row + side, col : col + side][:, mask] = colour
    return image


def render_batch(scenes: list[Scene], size: int = 32, seed: int = 0) -> np.ndarray:
    """float32 [N, 3, size, size]: image i from its own stream of `seed` (it does not depend on
    the other scenes in the batch)."""
    streams = np.random.SeedSequence(seed).spawn(len(scenes))
    images = [
        render(s, size, np.random.default_rng(ss)) for s, ss in zip(scenes, streams, strict=True)
    ]
    return np.stack(images) if images else np.zeros((0, 3, size, size), dtype=np.float32)
