"""A character-level chat tokenizer built locally with `tokenizers` (no model hub).

Every printable ASCII character, newline and tab is one token; chat special tokens are single ids.
The Jinja chat template is the `tiny` TITO family's ChatML (miles_core/tito/chatml.py: tools,
reasoning, tool calls and results), so multi-turn renders are prefix-stable: rendering turn N+1
starts with exactly the ids of turn N plus the assistant reply.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = [
    PAD,
    EOS,
    IM_START,
    IM_END,
    UNK,
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the character-level tokenizer; ids are stable across builds."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    # the `tiny` TITO family's ChatML template (tools in the system turn, `<think>` reasoning
    # kept in history, `<tool_call>` JSON, `<tool_response>` results): the model directory's
    # template renders exactly what the family tokenizes (`miles tito verify` compares the two);
    # for plain chats it gives the ids of the role/content-only template it replaced
    # (tests/test_tiny_chat_template.py). Imported here: miles_core.tito imports this module.
    from miles_core.tito.chatml import chat_template

    tok.chat_template = chat_template(keep_history_reasoning=True)
    return tok
