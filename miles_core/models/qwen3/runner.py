"""A lean Qwen3 forward over a slot KV cache, computed from packed copies of the HF weights.

Two entry points, both returning last-position logits (fp32):
- `prefill(slots, starts, chunks)`: new tokens of several sequences (right-padded), each written
  at positions start..start+len into its slot, attending to its cached prefix and causally within;
- `decode(slots, positions, tokens)`: one token per running sequence.

The computation is `Qwen3ForCausalLM.forward` (RMSNorm, q/k norms, RoPE, SDPA with GQA, SwiGLU)
with fewer, fused ops, because a decode step on small models is bound by per-op dispatch:
- q, k and v (input-norm weight folded in) are one GEMM; RoPE is x·cos + swap_halves(x)·sin±
  with the sign of rotate_half folded into the sin table (exact: the same products and sum as
  x·cos + rotate_half(x)·sin);
- the MLP's SiLU, gate·up product and both residual adds are GEMM epilogues (oneDNN);
- on CPU, GEMMs use oneDNN prepacked weights (packed once per weight change with a batch-size
  hint of 32; MKL takes a generic path on some CPUs, e.g. AMD, and runs 1.3–1.8× slower), except
  small fp32 weights (`PLAIN_MAX_ELEMENTS`), where a packed call's fixed cost exceeds the GEMM;
- `dtype=torch.bfloat16` runs the GEMMs and the residual stream in bf16 while q/k norms, RoPE,
  the KV cache, attention and the logits stay fp32 (CPU bf16 attention kernels are slow); decode
  is faster on CPUs with bf16 units, at a log-prob deviation of ≈1e-2 against an fp32 scorer
  (the low-precision contract: the trainer recomputes log-probs in fp32, the mismatch is logged).
  A CPU without bf16 GEMMs in oneDNN (AVX2 only: no AVX512-BF16/AMX or avx_ne_convert) gets the
  same numerics emulated (`bf16_gemms_native`): bf16-rounded weights and inputs, fp32 GEMMs, the
  output rounded to bf16 — what a native bf16 GEMM computes (fp32 accumulation), at fp32 speed
  (PyTorch's own bf16 GEMM there is ≈6× slower than fp32; oneDNN refuses to pack bf16 at all).
In fp32 the engine's log-probs match the trainer's recompute to ~1e-6. Packed copies are rebuilt
lazily after every weight change (`invalidate`); `verify_packed` checks them against the model's
tensors bitwise, so a weights check covers what actually generates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_core.device import bf16_gemms_native
from miles_core.engines.cpu.kv_cache import SlotKVCache
from miles_core.lora.delta import lora_term
from miles_core.lora.served import ServedAdapters
from miles_core.models.family import runner_refuses
from miles_core.models.moe import is_moe_layer
from miles_core.models.qwen3.runner_moe import MoEBlock

# fp32 weights up to this many elements stay plain tensors (F.linear) instead of oneDNN packs: a
# packed GEMM costs ≈10 µs more per call at these sizes (1 thread, 32 rows: 192×64 11.7 against
# 23.9 µs, 256×256 54 against 77 µs; 512×256 121 against 104 µs, where packing starts to win)
PLAIN_MAX_ELEMENTS = 65536


@dataclass
class _LayerWeights:
    qkv: torch.Tensor  # input-norm weight folded in
    qk_norm: torch.Tensor  # [H + KVH, hd]: q_norm weight per query head, k_norm per key head
    o: torch.Tensor
    gate: torch.Tensor | None  # post-attention-norm weight folded in (None: an MoE layer)
    up: torch.Tensor | None
    down: torch.Tensor | None
    moe: MoEBlock | None = None  # a mixture-of-experts layer's MLP (moe.py)


@dataclass
class _Weights:
    embed: torch.Tensor
    layers: list[_LayerWeights]
    lm_head: torch.Tensor  # final-norm weight folded in


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two (possibly oneDNN-packed) weights."""
    a = a.to_dense() if a.is_mkldnn else a
    b = b.to_dense() if b.is_mkldnn else b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


class Qwen3Runner:
    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        cfg = model.config
        reason = runner_refuses(cfg)
        if reason is not None:
            raise ValueError(f"the serving engine's runner cannot run this model: {reason}")
        self.model = model
        self.cfg = cfg
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len or cfg.max_position_embeddings
        inv_freq = model.model.rotary_emb.inv_freq.float().cpu()
        pos = torch.arange(self.max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(model.model.rotary_emb, "attention_scaling", 1.0)
        # [max_len, head_dim] each; rotate_half(x)·sin == swap_halves(x)·sin± with sin± the sin
        # table with its first half negated (a sign flip commutes exactly with the product)
        half = self.head_dim // 2
        sin = emb.sin() * scale
        self.cos = (emb.cos() * scale).to(self.device)
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.device)
        self.scaling = self.head_dim**-0.5
        self.moe_layers = sum(is_moe_layer(layer.mlp) for layer in model.model.layers)
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.cache = SlotKVCache(
            cfg.num_hidden_layers,
            slots,
            self.n_kv,
            self.max_len,
            self.head_dim,
            device=self.device,
            routes=self.routes_shape,
        )
        self.use_onednn = self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        # bf16 numerics with fp32 GEMMs where the CPU has no bf16 GEMMs (see the module docstring)
        self.emulate_bf16 = dtype == torch.bfloat16 and not bf16_gemms_native(self.device)
        self.gemm_dtype = torch.float32 if self.emulate_bf16 else dtype
        self._w: _Weights | None = None
        self.lora: ServedAdapters | None = None  # the engine's adapters (lora/served.py)
        self.last_routes: torch.Tensor | None = None  # MoE models: the last forward's experts

    @property
    def routes_shape(self) -> tuple[int, int] | None:
        """(MoE layers, top_k) of one position's routes; None for a dense model."""
        return (self.moe_layers, self.top_k) if self.moe_layers else None

    def routes_of(self, slot: int, length: int) -> torch.Tensor | None:
        """The routes of a slot's first `length` positions [length, MoE layers, top_k] (CPU
        int32), or None for a dense model or a released cache."""
        return self.cache.routes_of(slot, length)

    def invalidate(self) -> None:
        """Weights changed (update, release, resume): drop the packed copies."""
        self._w = None

    # ------------------------------------------------------------------ packing
    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        # rounded to the compute dtype, then held in the GEMM dtype (fp32 when bf16 is emulated)
        w = w.detach().to(self.dtype).to(self.gemm_dtype).contiguous()
        small = self.gemm_dtype == torch.float32 and w.numel() <= PLAIN_MAX_ELEMENTS
        if self.use_onednn and not small:
            return torch.ops.mkldnn._reorder_linear_weight(w, 32)
        return w

    def _weights(self) -> _Weights:
        if self._w is None:
            self._w = self._build()
        return self._w

    def verify_packed(self) -> list[str]:
        """The packed copies the runner decodes with, compared bitwise with a fresh pack of the
        model's current tensors; returns the names of those that differ ([] if all agree). With
        nothing packed yet it packs now (the next step would, from the same tensors)."""
        if self._w is None:
            self._weights()
            return []
        fresh, held = self._build(), self._w
        bad = []
        for i, (f, h) in enumerate(zip(fresh.layers, held.layers, strict=True)):
            for name in ("qkv", "qk_norm", "o", "gate", "up", "down"):
                a, b = getattr(f, name), getattr(h, name)
                if (a is None) != (b is None) or (a is not None and not _same(a, b)):
                    bad.append(f"layers.{i}.{name}")
        for name in ("embed", "lm_head"):
            if not _same(getattr(fresh, name), getattr(held, name)):
                bad.append(name)
        return bad

    def _build(self) -> _Weights:
        m = self.model.model
        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            in_norm = layer.input_layernorm.weight
            post_norm = layer.post_attention_layernorm.weight
            qkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), dim=0)
            layers.append(
                _LayerWeights(
                    qkv=self._pack(qkv * in_norm),
                    qk_norm=torch.cat(
                        (
                            a.q_norm.weight.detach().expand(self.n_heads, -1),
                            a.k_norm.weight.detach().expand(self.n_kv, -1),
                        )
                    ).float(),
                    o=self._pack(a.o_proj.weight),
                    **self._mlp(mlp, post_norm),
                )
            )
        return _Weights(
            embed=m.embed_tokens.weight.detach().to(self.dtype),
            layers=layers,
            lm_head=self._pack(self.model.lm_head.weight * m.norm.weight),
        )

    def _mlp(self, mlp: torch.nn.Module, post_norm: torch.Tensor) -> dict:
        if is_moe_layer(mlp):  # runs on the live modules: nothing packed
            return dict(gate=None, up=None, down=None, moe=MoEBlock(mlp, post_norm))
        return dict(
            gate=self._pack(mlp.gate_proj.weight * post_norm),
            up=self._pack(mlp.up_proj.weight * post_norm),
            down=self._pack(mlp.down_proj.weight),
        )

    # ------------------------------------------------------------------ GEMMs (+ epilogues)
    def _gemm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        epilogue: str = "none",
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x·wᵀ with an optional epilogue (swish; mul or add of `other`), in the compute dtype.
        Emulated bf16: the bf16 operands widened exactly to fp32, the result rounded to bf16."""
        if self.emulate_bf16:
            x = x.float()
            other = None if other is None else other.float()
        if w.is_mkldnn:
            if other is None:
                y = torch.ops.mkldnn._linear_pointwise(x, w, None, epilogue, [], "")
            else:
                y = torch.ops.mkldnn._linear_pointwise.binary(x, other, w, None, epilogue)
        else:
            y = F.linear(x, w)
            if epilogue == "swish":
                y = F.silu(y)
            elif epilogue == "mul":
                y = y * other
            elif epilogue == "add":
                y = other + y
        return y.to(self.dtype) if self.emulate_bf16 else y

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, w)

    def _mm_silu(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, w, "swish")

    def _mm_mul(self, x: torch.Tensor, other: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, w, "mul", other)

    def _mm_add(self, x: torch.Tensor, other: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, w, "add", other)

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dim in one fused op (the norm weight lives in the next GEMM;
        in fp32 bitwise equal to x · rsqrt(mean(x²) + eps), 1.3–2× faster than those 4 ops)."""
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    # ------------------------------------------------------------------ forward
    def _layers(self, w: _Weights, h: torch.Tensor, positions: torch.Tensor, write, read, mask):
        """h [B, T, D]; positions [B, T]; `write(layer, kv)` stores kv [B, T, 2·KVH, hd];
        `read(layer)` gives keys and values [B, KVH, K, hd]; mask [B, 1, T, K] (bool)."""
        b, t, _ = h.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        half = hd // 2
        cos = self.cos[positions].unsqueeze(2)  # [B, T, 1, hd], shared by every layer
        sin = self.sin_signed[positions].unsqueeze(2)
        routes: list[torch.Tensor] = []
        lora = self.lora if self.lora is not None and self.lora.active else None
        for i, lw in enumerate(w.layers):
            xn = self._rms(h)
            qkv = self._mm(xn, lw.qkv)
            if lora is not None:
                qkv = self._qkv_terms(lora, i, xn, qkv)
            qkv = qkv.view(b, t, nh + 2 * nkv, hd).float()
            qk = self._rms(qkv[:, :, : nh + nkv]) * lw.qk_norm
            # RoPE for q and k at once: qk·cos + rotate_half(qk)·sin
            swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            qk = (qk * cos).add_(swapped.mul_(sin))
            q = qk[:, :, :nh]
            write(i, torch.cat((qk[:, :, nh:], qkv[:, :, nh + nkv :]), dim=2))
            keys, values = read(i)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=nh != nkv,
            )
            o = o.transpose(1, 2).reshape(b, t, nh * hd).to(self.dtype)
            h = self._mm_add(o, h, lw.o)
            if lora is not None:
                h = self._plus(h, lora, f"model.layers.{i}.self_attn.o_proj", o)
            x = self._rms(h)
            if lw.moe is not None:
                out, experts = lw.moe(x)
                h = h + out.to(h.dtype)
                routes.append(experts)
            elif lora is not None:
                h = self._mlp_with_adapters(lora, i, lw, x, h)
            else:
                h = self._mm_add(self._mm_mul(x, self._mm_silu(x, lw.gate), lw.up), h, lw.down)
        # [B, T, MoE layers, top_k]: the experts each position of this forward was routed to
        self.last_routes = torch.stack(routes, dim=2) if routes else None
        return h

    # ------------------------------------------------------------------ LoRA adapters
    # each row's adapter term (lora/delta.py) added to the base projection; the norm weights
    # folded into the packed GEMMs are applied to the adapters' input here
    def _plus(self, y: torch.Tensor, lora, module: str, x: torch.Tensor) -> torch.Tensor:
        term = lora_term(x.float(), lora.groups(module))
        return y if term is None else (y.float() + term).to(y.dtype)

    def _qkv_terms(self, lora, i: int, xn: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        layer = self.model.model.layers[i]
        x = xn.float() * layer.input_layernorm.weight.float()
        widths = (
            self.n_heads * self.head_dim,
            self.n_kv * self.head_dim,
            self.n_kv * self.head_dim,
        )
        parts = list(qkv.split(widths, dim=-1))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            parts[j] = self._plus(parts[j], lora, f"model.layers.{i}.self_attn.{name}", x)
        return torch.cat(parts, dim=-1)

    def _mlp_with_adapters(self, lora, i: int, lw: _LayerWeights, x: torch.Tensor, h):
        """The dense MLP unfused (the adapters' terms enter before the activation)."""
        mlp = f"model.layers.{i}.mlp"
        x_in = x.float() * self.model.model.layers[i].post_attention_layernorm.weight.float()
        gate = self._plus(self._mm(x, lw.gate), lora, f"{mlp}.gate_proj", x_in)
        up = self._plus(self._mm(x, lw.up), lora, f"{mlp}.up_proj", x_in)
        act = (F.silu(gate.float()) * up.float()).to(self.dtype)
        down = self._plus(self._mm(act, lw.down), lora, f"{mlp}.down_proj", act)
        return h + down.to(h.dtype)

    def _logits(self, w: _Weights, h_last: torch.Tensor) -> torch.Tensor:
        xn = self._rms(h_last)
        logits = self._mm(xn, w.lm_head).float()
        if self.lora is not None and self.lora.active:
            x = xn.float() * self.model.model.norm.weight.float()
            logits = self._plus(logits, self.lora, "lm_head", x)
        return logits

    def _ids(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ entry points
    @torch.inference_mode()
    def prefill(self, slots: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Runs the uncached tail of each sequence; returns logits of each sequence's last token [B, V]."""
        w = self._weights()
        bsz = len(slots)
        lens = [len(c) for c in chunks]
        width = max(lens)
        ids = torch.zeros((bsz, width), dtype=torch.long)
        positions = torch.zeros((bsz, width), dtype=torch.long)
        for i, (s, c) in enumerate(zip(starts, chunks, strict=True)):
            ids[i, : len(c)] = torch.tensor(c)
            positions[i] = torch.arange(s, s + width).clamp(max=self.max_len - 1)
        ids, positions = ids.to(self.device), positions.to(self.device)
        total = max(s + n for s, n in zip(starts, lens, strict=True))
        key_pos = torch.arange(total, device=self.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # causal incl. prefix
        slot_t = self._ids(slots)
        kv = self.cache.kv

        def write(layer: int, new: torch.Tensor) -> None:
            for i, (slot, s, n) in enumerate(zip(slots, starts, lens, strict=True)):
                kv[layer][slot, s : s + n] = new[i, :n]

        def read(layer: int):
            return self._split(kv[layer][slot_t, :total])

        h = self._layers(w, w.embed[ids], positions, write, read, mask)
        self.cache.record_routes(slots, starts, lens, self.last_routes)
        last = self._ids([n - 1 for n in lens])
        return self._logits(w, h[torch.arange(bsz, device=self.device), last])

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per sequence at `positions`; returns logits [B, V]."""
        w = self._weights()
        bsz = len(slots)
        slot_t = self._ids(slots)
        pos_t = self._ids(positions)
        total = max(positions) + 1
        mask = torch.arange(total, device=self.device)[None, :] <= pos_t[:, None]
        mask = mask.view(bsz, 1, 1, total)
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + bsz))
        kv = self.cache.kv

        def write(layer: int, new: torch.Tensor) -> None:
            kv[layer][slot_t, pos_t] = new[:, 0]

        def read(layer: int):
            if contiguous:  # a view, no gather
                return self._split(kv[layer][lo : lo + bsz, :total])
            return self._split(kv[layer][slot_t, :total])

        h = w.embed[self._ids(tokens)].view(bsz, 1, -1)
        h = self._layers(w, h, pos_t.view(bsz, 1), write, read, mask)
        self.cache.record_routes(slots, positions, [1] * bsz, self.last_routes)
        return self._logits(w, h[:, 0])

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, K, 2·KVH, hd] → keys, values [B, KVH, K, hd] (views)."""
        kv = kv.transpose(1, 2)
        return kv[:, : self.n_kv], kv[:, self.n_kv :]
