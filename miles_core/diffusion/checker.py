"""A GenEval-style checker: does a generated image show the scene its prompt asked for?

It reads the image alone. Each pixel is background (its brightest channel below
`BRIGHTNESS`) or the nearest palette colour. The pixels of the asked colour form 4-connected
components; those smaller than `MIN_AREA_FRACTION` of the image are specks and ignored. The
rest are the objects, scored on four attributes, each 0 or 1:

    colour    the objects hold at least `DOMINANT` of the non-background pixels
    count     the number of objects is the asked count
    shape     every object has the asked shape (judged by `shape_of`)
    position  every object's centroid lies in the named half

`all` is 1 when all four are, and `reward` is their mean: a dense reward in [0, 1]. With no
object, every attribute is 0.

`shaped` gives partial credit where the four give 0 or 1, a denser training signal: the asked
colour's share of the foreground, a count off by k scores 1 − k/3, each object's shape scores
by how far its fill and aspect lie outside the asked shape's band (0 past `SHAPE_MARGIN`), and
the share of objects in the named half; `shaped` is their mean, 1 exactly when the image is a
clean rendering of the scene.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from miles_core.diffusion.scenes import COLOURS, COUNTS, PALETTE, Scene

BRIGHTNESS = 0.5  # in [0, 1]: a pixel whose brightest channel is below this is background
DOMINANT = 0.5  # the asked colour's objects' share of the non-background pixels
# specks: the smallest rendered object (a triangle size/5 across) covers about 1/50 of the
# image, so 1/200 ignores noise a quarter of its size and smaller
MIN_AREA_FRACTION = 1 / 200
ASPECT = (2 / 3, 3 / 2)  # width / height of an object's bounding box; all three shapes are ≈ 1
# fill = the object's pixels / its bounding box's. Rendered (sides 5..16 px): squares 1.0,
# circles 0.755..0.889, triangles 0.502..0.600; the cuts sit midway between
SQUARE_FILL = 0.945  # fill >= this: square
CIRCLE_FILL = 0.68  # CIRCLE_FILL <= fill < SQUARE_FILL: circle; below: triangle
TRIANGLE_FILL = 0.35  # fill below this is no shape (a thin diagonal, a ring)

ATTRIBUTES = ("colour", "count", "shape", "position")
SCORES = (*ATTRIBUTES, "all", "reward", "shaped")  # what `check` returns

FILL_BANDS = {  # the fill each shape's objects have (shape_of's cuts)
    "square": (SQUARE_FILL, 1.0),
    "circle": (CIRCLE_FILL, SQUARE_FILL),
    "triangle": (TRIANGLE_FILL, CIRCLE_FILL),
}
SHAPE_MARGIN = 0.25  # `shaped`: an object's shape credit falls to 0 this far outside its band

_PALETTE = np.asarray([PALETTE[c] for c in COLOURS], dtype=np.float32)  # [colours, 3]


def colour_map(image: np.ndarray) -> np.ndarray:
    """int [H, W]: each pixel's index into COLOURS, or -1 for background. `image` is float
    [3, H, W] in [-1, 1]; values outside are clipped."""
    image = np.asarray(image, dtype=np.float32)
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be [3, H, W] in [-1, 1]; got shape {image.shape}")
    rgb = (np.clip(image, -1.0, 1.0).transpose(1, 2, 0) + 1) / 2  # [H, W, 3] in [0, 1]
    distance = ((rgb[:, :, None, :] - _PALETTE) ** 2).sum(-1)  # [H, W, colours]
    labels = distance.argmin(-1)
    labels[rgb.max(-1) < BRIGHTNESS] = -1
    return labels


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a boolean [H, W] mask, each as int [n, 2] (row, col)."""
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    found = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        seen[start] = True
        queue, pixels = deque([start]), []
        while queue:  # breadth-first flood fill
            r, c = queue.popleft()
            pixels.append((r, c))
            for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                if 0 <= nr < height and 0 <= nc < width and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    queue.append((nr, nc))
        found.append(np.asarray(pixels, dtype=np.int64))
    return found


def fill_and_aspect(pixels: np.ndarray) -> tuple[float, float]:
    """(pixels / bounding-box area, box width / height) of one component."""
    height, width = pixels.max(0) - pixels.min(0) + 1
    return len(pixels) / float(height * width), float(width / height)


def shape_of(pixels: np.ndarray) -> str | None:
    """The shape one component looks like, or None (too elongated or too sparse)."""
    fill, aspect = fill_and_aspect(pixels)
    if not ASPECT[0] <= aspect <= ASPECT[1] or fill < TRIANGLE_FILL:
        return None
    if fill >= SQUARE_FILL:
        return "square"
    return "circle" if fill >= CIRCLE_FILL else "triangle"


def shape_credit(pixels: np.ndarray, shape: str) -> float:
    """1 for an object of the asked shape, falling linearly to 0 as its fill and aspect move
    `SHAPE_MARGIN` outside the shape's bands."""
    fill, aspect = fill_and_aspect(pixels)
    low, high = FILL_BANDS[shape]
    off = max(low - fill, fill - high, 0.0) + max(ASPECT[0] - aspect, aspect - ASPECT[1], 0.0)
    if shape != "square" and fill >= SQUARE_FILL:  # the band's top is exclusive
        off = max(off, 1e-3)
    return max(0.0, 1.0 - off / SHAPE_MARGIN)


def in_half(pixels: np.ndarray, position: str, height: int, width: int) -> bool:
    """Whether the component's centroid (of pixel centres) lies in the named half."""
    row, col = pixels.mean(0) + 0.5
    return {
        "left": col < width / 2,
        "right": col > width / 2,
        "top": row < height / 2,
        "bottom": row > height / 2,
    }[position]


def check(image: np.ndarray, scene: Scene) -> dict[str, float]:
    """The attributes `colour`, `count`, `shape`, `position` (each 0.0 or 1.0), `all`, and
    `reward` (their mean) of `image` (float [3, H, W] in [-1, 1]) against `scene`."""
    labels = colour_map(image)
    height, width = labels.shape
    min_area = max(2, round(MIN_AREA_FRACTION * height * width))
    mask = labels == COLOURS.index(scene.colour)
    objects = [p for p in components(mask) if len(p) >= min_area]
    foreground = int((labels >= 0).sum())
    covered = sum(len(p) for p in objects)
    scores = {
        "colour": bool(objects) and covered >= DOMINANT * foreground,
        "count": len(objects) == scene.count,
        "shape": bool(objects) and all(shape_of(p) == scene.shape for p in objects),
        "position": bool(objects)
        and all(in_half(p, scene.position, height, width) for p in objects),
    }
    result = {name: float(ok) for name, ok in scores.items()}
    result["all"] = float(all(scores.values()))
    result["reward"] = sum(scores.values()) / len(scores)
    partial = [0.0, 0.0, 0.0, 0.0]
    if objects:
        inside = [in_half(p, scene.position, height, width) for p in objects]
        partial = [
            covered / foreground,
            max(0.0, 1 - abs(len(objects) - scene.count) / max(COUNTS)),
            float(np.mean([shape_credit(p, scene.shape) for p in objects])),
            float(np.mean(inside)),
        ]
    result["shaped"] = sum(partial) / len(partial)
    return result
