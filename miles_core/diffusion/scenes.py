"""Compositional scene prompts: count × colour × shape × position, e.g. "two red squares on the
left".

Every prompt is exactly six words from `VOCABULARY` (count, colour, shape, then a three-word
position phrase), so a model can embed it as a fixed-length row of word ids (`prompt_ids`).
`split_scenes` holds out whole (colour, shape) pairs, so evaluating on the held-out scenes
measures compositional generalisation: every colour and every shape is seen in training, but
never in those combinations.
"""

from __future__ import annotations

from dataclasses import dataclass

# the one RGB palette (channels in [0, 1]); the renderer draws with it, the checker reads it back
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
COUNTS: tuple[int, ...] = (1, 2, 3)
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom")

COUNT_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three"}
PLURALS: dict[str, str] = {shape: shape + "s" for shape in SHAPES}
# the words before the position's name: "on the left", "at the top"
POSITION_PHRASES: dict[str, tuple[str, str]] = {
    "left": ("on", "the"),
    "right": ("on", "the"),
    "top": ("at", "the"),
    "bottom": ("at", "the"),
}

# every word a prompt can use, in a fixed order: a word's id is its index here
VOCABULARY: tuple[str, ...] = (
    *COUNT_WORDS.values(),
    *COLOURS,
    *(word for shape in SHAPES for word in (shape, PLURALS[shape])),
    "on",
    "at",
    "the",
    *POSITIONS,
)
_WORD_IDS: dict[str, int] = {word: i for i, word in enumerate(VOCABULARY)}
_FORM = "'<{}> <{}> <{}> <{}>'".format(
    "|".join(COUNT_WORDS.values()),
    "|".join(COLOURS),
    "|".join(f"{shape}(s)" for shape in SHAPES),
    "|".join(" ".join((*POSITION_PHRASES[p], p)) for p in POSITIONS),
)

# held out of training: one pair per shape, each with a different colour (yellow keeps all
# three), so every colour and every shape still appears in training; 3 of the 12 pairs
HELD_OUT_PAIRS: tuple[tuple[str, str], ...] = (
    ("red", "triangle"),
    ("green", "circle"),
    ("blue", "square"),
)


@dataclass(frozen=True)
class Scene:
    """`count` objects of one `colour` and `shape`, all in the named half of the image."""

    count: int
    colour: str
    shape: str
    position: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("count", self.count, COUNTS),
            ("colour", self.colour, COLOURS),
            ("shape", self.shape, SHAPES),
            ("position", self.position, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"Scene {name} {value!r} is not one of {allowed}")

    @property
    def prompt(self) -> str:
        shape = self.shape if self.count == 1 else PLURALS[self.shape]
        words = (COUNT_WORDS[self.count], self.colour, shape)
        return " ".join((*words, *POSITION_PHRASES[self.position], self.position))

    @classmethod
    def parse(cls, text: str) -> Scene:
        """The scene whose `prompt` is `text` (words separated by any whitespace)."""
        words = _words(text)
        if len(words) != 6:
            raise ValueError(f"prompt {text!r} has {len(words)} words; expected 6: {_FORM}")
        count_word, colour, shape_word, *phrase, position = words
        counts = {word: n for n, word in COUNT_WORDS.items()}
        if count_word not in counts or colour not in COLOURS or position not in POSITIONS:
            raise ValueError(f"prompt {text!r} is not of the form {_FORM}")
        count = counts[count_word]
        shapes = {(PLURALS[s] if count > 1 else s): s for s in SHAPES}
        if shape_word not in shapes:
            raise ValueError(
                f"prompt {text!r}: {shape_word!r} after {count_word!r} must be one of "
                f"{tuple(shapes)}"
            )
        if tuple(phrase) != POSITION_PHRASES[position]:
            expected = " ".join((*POSITION_PHRASES[position], position))
            raise ValueError(f"prompt {text!r}: the position must read {expected!r}")
        return cls(count, colour, shapes[shape_word], position)


def _words(text: str) -> list[str]:
    """The prompt's words, each checked against the vocabulary."""
    words = text.split()
    for word in words:
        if word not in _WORD_IDS:
            raise ValueError(
                f"unknown word {word!r} in prompt {text!r}: prompts use only the words "
                f"{VOCABULARY} (lower case)"
            )
    return words


def prompt_ids(text: str) -> list[int]:
    """The prompt's words as indices into `VOCABULARY`."""
    return [_WORD_IDS[word] for word in _words(text)]


def all_scenes() -> list[Scene]:
    """Every scene, in a fixed order (colour, shape, count, position)."""
    return [
        Scene(count, colour, shape, position)
        for colour in COLOURS
        for shape in SHAPES
        for count in COUNTS
        for position in POSITIONS
    ]


def split_scenes() -> tuple[list[Scene], list[Scene]]:
    """(train, held_out): the held-out scenes are those of a (colour, shape) in HELD_OUT_PAIRS."""
    held = set(HELD_OUT_PAIRS)
    scenes = all_scenes()
    train = [s for s in scenes if (s.colour, s.shape) not in held]
    held_out = [s for s in scenes if (s.colour, s.shape) in held]
    return train, held_out
