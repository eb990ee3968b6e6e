"""`tiny`: our character-level tokenizer (miles_core/models/tokenizer.py) with the ChatML template,
keeping every assistant's reasoning in history, so every render is append-only."""

from __future__ import annotations

from miles_core.tito.chatml import ChatMLFamily
from miles_core.tito.registry import FAMILIES


@FAMILIES.register("tiny")
class TinyFamily(ChatMLFamily):
    name = "tiny"
    limits = ("characters outside printable ASCII become <|unk|>",)
    ascii_only = True

    def __init__(self):
        from miles_core.models.tokenizer import build_tokenizer  # transformers: when built

        super().__init__(build_tokenizer(), keep_history_reasoning=True)
