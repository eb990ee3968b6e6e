"""The shared-prompt forward: a GRPO group's samples share their prompt, so the training forward
runs each distinct prompt once and the group's responses attend to its keys and values, instead
of running the prompt again in every row of a padded batch.

It is exact: the prompt's activations are the same in every row that holds it, and the gradient
through the repeated keys and values sums the group's contributions, which is what the padded
batch computes row by row. Only the rounding differs (other GEMM shapes). With 4 prompts of ~24
tokens × 8 samples × 32 new tokens it feeds 39 % fewer tokens through the model (1,088 against
1,792).

Two forward calls of an HF causal LM (`cache`, `position_ids`, `attention_mask`,
`logits_to_keep`), both through the root module, so FSDP2 gathers and frees its parameters as
usual:

- the prompts, left-padded [G, P] into a `DynamicCache` (with gradient), keeping only the last
  position's logits: they predict every row's first response token;
- the responses less their last token, right-padded [B, R-1], after the cache rows of their
  prompts (`batch_select_indices`): position r predicts response token r+1.

`SharedPrefix.build` returns None where sharing saves nothing (no two rows with one prompt) or
does not apply: a row without a prompt token, or a sequence-aligned token field (a forward that
consumes one per position, e.g. routing replay, sees the padded rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.token_fields import token_field
from miles_core.train.batch import TrainBatch
from miles_core.train.padding import pad_rows


@dataclass
class SharedPrefix:
    """One micro-batch laid out as distinct prompts (G rows) + responses (B rows)."""

    prefix_ids: torch.Tensor  # [G, P] left-padded prompts
    prefix_mask: torch.Tensor  # [G, P] 1 on prompt tokens
    prefix_positions: torch.Tensor  # [G, P]
    row_prompt: torch.Tensor  # [B] which prompt row each sample extends
    suffix_ids: torch.Tensor  # [B, R-1] each response without its last token, right-padded
    suffix_mask: torch.Tensor  # [B, R-1]
    suffix_positions: torch.Tensor  # [B, R-1]

    @classmethod
    def build(cls, batch: TrainBatch, pad_id: int) -> SharedPrefix | None:
        if any(token_field(name).align == "sequence" for name in batch.token_fields):
            return None
        prompts: dict[tuple[int, ...], int] = {}
        row_prompt: list[int] = []
        for toks, n in zip(batch.tokens, batch.response_lengths, strict=True):
            p = len(toks) - n
            if p < 1:
                return None
            row_prompt.append(prompts.setdefault(tuple(toks[:p]), len(prompts)))
        if len(prompts) == len(batch):
            return None
        width = max(len(p) for p in prompts)
        prefix_ids = pad_rows(list(prompts), width, pad_id, torch.long, left=True)
        prefix_mask = pad_rows([[1] * len(p) for p in prompts], width, 0, torch.long, left=True)
        resp = max(max(batch.response_lengths), 1)
        lengths = batch.response_lengths
        # each response less its last token (none for a 0- or 1-token response)
        suffixes = [
            t[len(t) - n : -1] if n > 1 else [] for t, n in zip(batch.tokens, lengths, strict=True)
        ]
        suffix_ids = pad_rows(suffixes, resp - 1, pad_id, torch.long)
        suffix_mask = pad_rows([[1] * len(x) for x in suffixes], resp - 1, 0, torch.long)
        starts = torch.tensor([len(t) - n for t, n in zip(batch.tokens, lengths, strict=True)])
        return cls(
            prefix_ids=prefix_ids,
            prefix_mask=prefix_mask,
            prefix_positions=(prefix_mask.cumsum(1) - 1).clamp(min=0),
            row_prompt=torch.tensor(row_prompt, dtype=torch.long),
            suffix_ids=suffix_ids,
            suffix_mask=suffix_mask,
            suffix_positions=starts[:, None] + torch.arange(resp - 1),
        )

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens the padded batch would run and this layout does not."""
        per_prompt = self.prefix_mask.sum(1)
        return int(per_prompt[self.row_prompt].sum() - per_prompt.sum())

    def to(self, device: torch.device | str) -> SharedPrefix:
        return SharedPrefix(**{k: v.to(device) for k, v in vars(self).items()})


def response_logits(model, layout: SharedPrefix) -> torch.Tensor:
    """[B, R, V] logits predicting each response token, as the padded forward's
    `logits.gather(targets_index)` gives them."""
    from transformers import DynamicCache  # (importing this module stays cheap)

    cache = DynamicCache()
    first = model(
        input_ids=layout.prefix_ids,
        attention_mask=layout.prefix_mask,
        position_ids=layout.prefix_positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[layout.row_prompt]  # [B, 1, V]
    if layout.suffix_ids.shape[1] == 0:
        return first
    cache.batch_select_indices(layout.row_prompt)
    rest = model(
        input_ids=layout.suffix_ids,
        attention_mask=torch.cat([layout.prefix_mask[layout.row_prompt], layout.suffix_mask], 1),
        position_ids=layout.suffix_positions,
        cache=cache,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], 1)
