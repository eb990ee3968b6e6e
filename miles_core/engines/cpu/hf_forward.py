"""`BatchForward` on the model's own modules: left-padded prompts, a `DynamicCache`, one token
per row per step. Works for any causal LM transformers loads; nothing is derived from the
weights, so there is nothing to invalidate."""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from miles_core.lora.delta import lora_term
from miles_core.lora.targets import SERVED
from miles_core.train.padding import pad_rows


def _add_term(adapters, name: str, module, inputs, output):
    term = lora_term(inputs[0], adapters.groups(name))
    return output if term is None else output + term.to(output.dtype)


class HFForward:
    def __init__(self, model: torch.nn.Module, pad_id: int):
        self.model = model
        self.pad_id = pad_id
        self._cache: DynamicCache | None = None
        self._mask = self._pos = torch.zeros((0, 0), dtype=torch.long)

    def prefill(self, prompts: list[list[int]], row_prompt: list[int], length: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = pad_rows(prompts, width, self.pad_id, torch.long, left=True)
        mask = pad_rows([[1] * len(p) for p in prompts], width, 0, torch.long, left=True)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        self._cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, position)
        if len(prompts) < len(row_prompt):  # one row per request from now on
            expand = torch.tensor(row_prompt)
            logits, mask, position = logits[expand], mask[expand], position[expand]
            self._cache.batch_select_indices(expand)
        self._mask, self._pos = mask, position[:, -1:]
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        self._pos = self._pos + 1
        ones = torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype)
        self._mask = torch.cat([self._mask, ones], dim=1)
        return self._forward(tokens.unsqueeze(1), self._mask, self._pos)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=self._cache, use_cache=True
        )
        return out.logits[:, -1, :]

    def use_adapters(self, adapters) -> None:
        """Each adapted linear module adds its rows' adapter terms (a forward hook)."""
        modules = dict(self.model.named_modules())
        for name in adapters.linears:
            if SERVED.fullmatch(name):
                modules[name].register_forward_hook(functools.partial(_add_term, adapters, name))

    def invalidate(self) -> None:
        """Nothing derived from the weights."""

    def stale(self) -> list[str]:
        return []
