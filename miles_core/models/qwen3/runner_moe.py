"""The serving runner's mixture-of-experts MLP (`runner.py`): one layer's router and experts,
run on the model's own HF modules.

The router is the family's module itself (Qwen3-MoE's softmax top-k, GLM4-MoE's sigmoid top-k
with its correction bias and groups), so the engine picks experts by exactly the trainer's rule;
the experts (and GLM4-MoE's shared experts) likewise. The input is the layer's
post-attention-normed hidden state; the block returns the MLP's output and the top-k expert
indices of every token ([tokens, top_k], what routing replay records). Computed in fp32 whatever
the runner's dtype (the expert weights are the model's fp32 tensors): nothing is packed, so a
weight update needs no repacking here.
"""

from __future__ import annotations

import torch


class MoEBlock:
    def __init__(self, mlp: torch.nn.Module, post_norm: torch.Tensor):
        self.mlp = mlp
        self.norm = post_norm  # the post-attention RMSNorm weight (a live parameter)
        self.shared = getattr(mlp, "shared_experts", None)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D], RMS-normed without its weight → (MLP output [B, T, D] fp32, expert
        indices [B, T, top_k] int64)."""
        b, t, d = x.shape
        flat = (x.float() * self.norm.float()).reshape(b * t, d)
        _, weights, idx = self.mlp.gate(flat)
        out = self.mlp.experts(flat, idx, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(b, t, d), idx.view(b, t, -1)
