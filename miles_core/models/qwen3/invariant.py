"""Qwen3's forward from the invariant kernels (`true_on_policy/ops.py`), over the HF modules' own
parameters: the one forward of `train.true_on_policy`, run by the engines (one token per row
over a KV cache) and by the trainer (whole sequences, with gradients).

Keys and values live at their absolute positions: the engine's slot KV cache
(`engines/cpu/kv_cache.py`) stores a sequence's position p at row p, and the trainer's keys of a
sequence starting at 0 are in that order already. A query at position p attends to rows [0, p],
summed over fixed chunks of positions (`ops.attention`), so its attention output is the same
whether it is decoded alone or computed inside a full forward, and every other op is per row. Logits, then, are the same bits for a token decoded by an engine and for the same
token in the trainer's forward of the finished sequence, whatever the batch.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from miles_core.true_on_policy import ops


class InvariantQwen3:
    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        self.model = model
        self.layers = int(cfg.num_hidden_layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.length = int(cfg.max_position_embeddings)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.cos, self.sin = ops.rope_table(self.length, self.head_dim, theta)
        self.scale = self.head_dim**-0.5

    # ------------------------------------------------------------------ one decoder layer
    def layer(
        self,
        layer: torch.nn.Module,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """h [B, T, D] at `positions` [B, T] → the layer's output. `cache`: (that layer's slot
        KV tensor [slots, L, 2·kv_heads, hd], the slot of each row): this call's keys are
        written at their positions and the slot's rows are attended to; None: the call's own
        keys, row r at position r (a full forward of sequences starting at 0)."""
        attn, b, t = layer.self_attn, h.shape[0], h.shape[1]
        x = ops.rms_norm(h, layer.input_layernorm.weight, self.eps)
        q = ops.dot(x, attn.q_proj.weight).view(b, t, self.heads, self.head_dim)
        k = ops.dot(x, attn.k_proj.weight).view(b, t, self.kv_heads, self.head_dim)
        v = ops.dot(x, attn.v_proj.weight).view(b, t, self.kv_heads, self.head_dim)
        q = ops.rms_norm(q, attn.q_norm.weight, self.eps).transpose(1, 2)
        k = ops.rms_norm(k, attn.k_norm.weight, self.eps).transpose(1, 2)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        v = v.transpose(1, 2)
        n = ops.padded_keys(int(positions.max()) + 1)  # keys at positions [0, n)
        if cache is None:
            if t > self.length:
                raise ValueError(f"{t} positions exceed max_position_embeddings {self.length}")
            keys, values = F.pad(k, (0, 0, 0, n - t)), F.pad(v, (0, 0, 0, n - t))
        else:
            kv, slots = cache
            index = torch.tensor(slots, device=kv.device)
            with torch.no_grad():
                new = torch.cat([k, v], dim=1).transpose(1, 2).to(kv.dtype)
                kv[index.unsqueeze(1).expand(b, t), positions] = new
            held = kv[index, : min(n, kv.shape[1])].transpose(1, 2)  # [B, 2·KVH, ≤n, hd]
            held = F.pad(held, (0, 0, 0, n - held.shape[2]))
            keys, values = held[:, : self.kv_heads], held[:, self.kv_heads :]
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        allowed = torch.arange(n, device=h.device) <= positions.unsqueeze(-1)
        o = ops.attention(q, keys, values, allowed, self.scale)
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        h = h + ops.dot(o, attn.o_proj.weight)
        x = ops.rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
        mlp = layer.mlp
        gated = ops.silu(ops.dot(x, mlp.gate_proj.weight)) * ops.dot(x, mlp.up_proj.weight)
        return h + ops.dot(gated, mlp.down_proj.weight)

    # ------------------------------------------------------------------ the whole model
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens.weight[ids].float()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = ops.rms_norm(h, self.model.model.norm.weight, self.eps)
        return ops.dot(h, self.model.lm_head.weight)

    def logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[torch.Tensor] | None = None,
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of `ids` at `positions` ([B, T]); with a slot KV cache (`kv`: one
        tensor per layer, `slots`: each row's), the keys of earlier positions come from it."""
        h = self.embed(ids)
        for i, layer in enumerate(self.model.model.layers):
            h = self.layer(layer, h, positions, None if kv is None else (kv[i], slots))
        return self.head(h)

    # ------------------------------------------------------------------ the trainer's forward
    def install(self) -> None:
        """Makes `model(input_ids=...)` (a trainer's forward of right-padded sequences starting
        at position 0) compute its logits by this forward. Each decoder layer is still called as
        a module, so wrappers acting around a layer's forward (FSDP2's unshard and gradient
        hooks) work as before."""
        inv = self
        for layer in self.model.model.layers:
            layer.forward = types.MethodType(
                lambda module, h, positions: inv.layer(module, h, positions), layer
            )

        def forward(model, input_ids: torch.Tensor, **_: Any) -> types.SimpleNamespace:
            b, t = input_ids.shape
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
            h = inv.embed(input_ids)
            for layer in model.model.layers:
                h = layer(h, positions)
            return types.SimpleNamespace(logits=inv.head(h))

        self.model.forward = types.MethodType(forward, self.model)
