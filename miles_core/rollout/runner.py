"""A lean Qwen3 forward over a slot KV cache, sharing the HF model's parameters.

Two entry points, both returning last-position logits:
- `prefill(slots, starts, chunks)`: new tokens of several sequences (right-padded), each written
  at positions start..start+len into its slot, attending to its cached prefix and causally within;
- `decode(slots, positions, tokens)`: one token per running sequence.
Numerically the same computation as `Qwen3ForCausalLM.forward` (RMSNorm in fp32, q/k norms,
RoPE, SDPA with GQA, SwiGLU), so engine log-probs match the trainer's recompute to ~1e-6.
Weights are read from the HF modules at call time, so in-place weight updates apply at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_core.rollout.kv_cache import SlotKVCache


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen3Runner:
    def __init__(self, model: torch.nn.Module, slots: int, max_len: int | None = None):
        cfg = model.config
        self.model = model
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len or cfg.max_position_embeddings
        inv_freq = model.model.rotary_emb.inv_freq.float()
        pos = torch.arange(self.max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(model.model.rotary_emb, "attention_scaling", 1.0)
        self.cos = emb.cos() * scale  # [max_len, head_dim]
        self.sin = emb.sin() * scale
        self.scaling = self.head_dim**-0.5
        self.cache = SlotKVCache(
            cfg.num_hidden_layers, slots, self.n_kv, self.max_len, self.head_dim
        )
        # oneDNN prepacked fp32 weights: on CPUs where MKL takes a generic path (e.g. AMD), the
        # GEMMs run ≈1.3–1.8× faster; repacked lazily after every weight update (`invalidate`)
        self.use_onednn = torch.backends.mkldnn.is_available()
        self._packed: dict[int, torch.Tensor] = {}

    def invalidate(self) -> None:
        """Weights changed (update, release, resume): drop the packed copies."""
        self._packed.clear()

    def _linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.use_onednn or module.weight.dtype != torch.float32:
            return module(x)
        packed = self._packed.get(id(module))
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 32)
            self._packed[id(module)] = packed
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    # ------------------------------------------------------------------ forward pieces
    def _qkv(self, attn, h: torch.Tensor, positions: torch.Tensor):
        """h [B, T, D], positions [B, T] → q [B, H, T, hd], k, v [B, KVH, T, hd] (RoPE applied)."""
        b, t, _ = h.shape
        q = self._linear(attn.q_proj, h).view(b, t, self.n_heads, self.head_dim)
        k = self._linear(attn.k_proj, h).view(b, t, self.n_kv, self.head_dim)
        v = self._linear(attn.v_proj, h).view(b, t, self.n_kv, self.head_dim)
        q = _rms(q, attn.q_norm.weight, attn.q_norm.variance_epsilon).transpose(1, 2)
        k = _rms(k, attn.k_norm.weight, attn.k_norm.variance_epsilon).transpose(1, 2)
        v = v.transpose(1, 2)
        cos = self.cos[positions].unsqueeze(1)  # [B, 1, T, hd]
        sin = self.sin[positions].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _layers(
        self, h: torch.Tensor, positions: torch.Tensor, write, read, mask: torch.Tensor
    ) -> torch.Tensor:
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q, k, v = self._qkv(attn, x, positions)
            write(i, k, v)
            keys, values = read(i)
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1)
            h = h + self._linear(attn.o_proj, o)
            x = _rms(
                h,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon,
            )
            mlp = layer.mlp
            gate = mlp.act_fn(self._linear(mlp.gate_proj, x))
            h = h + self._linear(mlp.down_proj, gate * self._linear(mlp.up_proj, x))
        return h

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        norm = self.model.model.norm
        return self._linear(self.model.lm_head, _rms(h_last, norm.weight, norm.variance_epsilon))

    # ------------------------------------------------------------------ entry points
    @torch.inference_mode()
    def prefill(self, slots: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Runs the uncached tail of each sequence; returns logits of each sequence's last token [B, V]."""
        bsz = len(slots)
        lens = [len(c) for c in chunks]
        width = max(lens)
        ids = torch.zeros((bsz, width), dtype=torch.long)
        positions = torch.zeros((bsz, width), dtype=torch.long)
        for i, (s, c) in enumerate(zip(starts, chunks, strict=True)):
            ids[i, : len(c)] = torch.tensor(c)
            positions[i] = torch.arange(s, s + width).clamp(max=self.max_len - 1)
        total = max(s + n for s, n in zip(starts, lens, strict=True))
        key_pos = torch.arange(total)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, K]: causal incl. prefix
        mask = mask.unsqueeze(1)
        slot_t = torch.tensor(slots)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for i, (slot, s, n) in enumerate(zip(slots, starts, lens, strict=True)):
                self.cache.k[layer][slot, :, s : s + n] = k[i, :, :n]
                self.cache.v[layer][slot, :, s : s + n] = v[i, :, :n]

        def read(layer: int):
            return self.cache.k[layer][slot_t, :, :total], self.cache.v[layer][slot_t, :, :total]

        h = self.model.model.embed_tokens(ids)
        h = self._layers(h, positions, write, read, mask)
        last = torch.tensor([n - 1 for n in lens])
        return self._logits(h[torch.arange(bsz), last])

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per sequence at `positions`; returns logits [B, V]."""
        bsz = len(slots)
        slot_t = torch.tensor(slots)
        pos_t = torch.tensor(positions)
        total = max(positions) + 1
        mask = (torch.arange(total)[None, :] <= pos_t[:, None]).view(bsz, 1, 1, total)
        contiguous = slots == list(range(slots[0], slots[0] + bsz))

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.cache.k[layer][slot_t, :, pos_t] = k[:, :, 0]
            self.cache.v[layer][slot_t, :, pos_t] = v[:, :, 0]

        def read(layer: int):
            if contiguous:  # a view, no gather
                lo = slots[0]
                return self.cache.k[layer][lo : lo + bsz, :, :total], self.cache.v[layer][
                    lo : lo + bsz, :, :total
                ]
            return self.cache.k[layer][slot_t, :, :total], self.cache.v[layer][slot_t, :, :total]

        h = self.model.model.embed_tokens(torch.tensor(tokens).view(bsz, 1))
        h = self._layers(h, pos_t.view(bsz, 1), write, read, mask)
        return self._logits(h[:, 0])
