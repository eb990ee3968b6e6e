"""Qwen3's forward from the invariant kernels (`true_on_policy/ops.py`), over a model's own
parameters: the one forward of `train.true_on_policy`, run by the engines (one token per row
over a KV cache) and by the trainers (whole sequences, with gradients).

Keys and values live at their absolute positions: the engine's slot KV cache
(`engines/cpu/kv_cache.py`) stores a sequence's position p at row p, and the trainer's keys of a
sequence starting at 0 are in that order already. A query at position p attends to rows [0, p],
summed over fixed chunks of positions (`ops.attention`), so its attention output is the same
whether it is decoded alone or computed inside a full forward, and every other op is per row.
Logits, then, are the same bits for a token decoded by an engine and for the same token in the
trainer's forward of the finished sequence, whatever the batch.

The weights come from the HF modules (`InvariantQwen3`: the engines, FSDP2) or from Megatron's
`GPTModel` (`MegatronInvariantQwen3`: its fused q/k/v and gate/up tensors read as the same
matrices, one tensor-parallel rank holding them whole).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles_core.lora.delta import LoraTerms, lora_term
from miles_core.models.family import family_of
from miles_core.models.moe import is_moe_layer
from miles_core.precision.qat import served, served_param
from miles_core.true_on_policy import ops


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor | None  # a dense MLP's (None: a mixture of experts, `mlp`)
    up: torch.Tensor | None
    down: torch.Tensor | None
    mlp: torch.nn.Module | None = None


def _mlp_weights(mlp: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return served(mlp.gate_proj), served(mlp.up_proj), served(mlp.down_proj)


class InvariantQwen3:
    def __init__(self, model: torch.nn.Module, cfg: Any = None):
        cfg = cfg if cfg is not None else model.config
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
        self.family = family_of(getattr(cfg, "model_type", None))  # an MoE's routing rule
        # the compute dtype: bfloat16 rounds every weight and activation to it (each op computes
        # in float32 on rounded inputs, its output rounded), the KV cache holding the same bits
        self.dtype = torch.float32
        # routing replay: (MoE layer, the experts a router chose [N, k]) -> the experts to run
        self.choose: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.record_routes = False  # keep each forward's experts in `last_routes` (engines)
        self.last_routes: torch.Tensor | None = None  # [B, T, MoE layers, k]
        self._routes: list[torch.Tensor] = []
        # LoRA: where a linear layer gets its adapters' terms (lora/delta.py; None: no adapters)
        self.lora: LoraTerms | None = None
        self._prefixes: dict[int, str] = {}

    # ------------------------------------------------------------------ where the weights are
    def decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.model.layers)

    def moe_mlps(self) -> list[torch.nn.Module]:
        """The mixture-of-experts MLPs, in layer order (what routing replay numbers)."""
        return [layer.mlp for layer in self.decoder_layers() if is_moe_layer(layer.mlp)]

    @property
    def routes_shape(self) -> tuple[int, int] | None:
        """(MoE layers, top_k) of one position's routes; None for a dense model."""
        moe = self.moe_mlps()
        return (len(moe), int(moe[0].gate.top_k)) if moe else None

    def weights(self, layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        dense = (None,) * 3 if is_moe_layer(mlp) else _mlp_weights(mlp)
        return LayerWeights(
            layer.input_layernorm.weight,
            served(attn.q_proj),
            served(attn.k_proj),
            served(attn.v_proj),
            attn.q_norm.weight,
            attn.k_norm.weight,
            served(attn.o_proj),
            layer.post_attention_layernorm.weight,
            *dense,
            mlp=mlp if is_moe_layer(mlp) else None,
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids).float()  # a lookup: exact

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight, output layer weight)."""
        return self.model.model.norm.weight, served(self.model.lm_head)

    # ------------------------------------------------------------------ the compute dtype
    def round(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the compute dtype, held in float32 (exact; nothing for float32)."""
        return x if self.dtype == torch.float32 else x.to(self.dtype).float()

    def linear(self, x: torch.Tensor, w: torch.Tensor, module: str | None = None) -> torch.Tensor:
        """x·wᵀ; with adapters on `module` (an HF module name), plus their term, computed by
        the same kernel (rows without an adapter add an exact zero)."""
        y = self.round(ops.dot(x, self.round(w)))
        if module is None or self.lora is None:
            return y
        term = lora_term(x, self.lora.groups(module), self._dot)
        return y if term is None else self.round(y + self.round(term))

    def _dot(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.round(ops.dot(x, self.round(w)))

    def site(self, layer: torch.nn.Module, path: str) -> str | None:
        """The HF module name of `path` in a decoder layer (`model.layers.<i>.<path>`), where a
        linear layer's adapters are looked up; None without adapters."""
        if self.lora is None:
            return None
        if not self._prefixes:
            layers = enumerate(self.decoder_layers())
            self._prefixes = {id(m): f"model.layers.{i}" for i, m in layers}
        return f"{self._prefixes[id(layer)]}.{path}"

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.round(ops.rms_norm(x, self.round(w), self.eps))

    def swiglu(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        sites: tuple[str | None, str | None, str | None] = (None, None, None),
    ):
        """`sites`: the module names of gate, up and down, where adapters apply."""
        act = self.round(ops.silu(self.linear(x, gate, sites[0])))
        return self.linear(self.round(act * self.linear(x, up, sites[1])), down, sites[2])

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
        w, b, t = self.weights(layer), h.shape[0], h.shape[1]
        x = self.norm(h, w.input_norm)
        q = self.linear(x, w.q, self.site(layer, "self_attn.q_proj"))
        k = self.linear(x, w.k, self.site(layer, "self_attn.k_proj"))
        v = self.linear(x, w.v, self.site(layer, "self_attn.v_proj"))
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        q = self.norm(q, w.q_norm).transpose(1, 2)
        k = self.norm(k, w.k_norm).transpose(1, 2)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        q, k = self.round(ops.rotate(q, cos, sin)), self.round(ops.rotate(k, cos, sin))
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
            held = kv[index, : min(n, kv.shape[1])].transpose(1, 2).float()  # [B, 2·KVH, ≤n, hd]
            held = F.pad(held, (0, 0, 0, n - held.shape[2]))
            keys, values = held[:, : self.kv_heads], held[:, self.kv_heads :]
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        allowed = torch.arange(n, device=h.device) <= positions.unsqueeze(-1)
        o = self.round(ops.attention(q, keys, values, allowed, self.scale))
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        h = self.round(h + self.linear(o, w.o, self.site(layer, "self_attn.o_proj")))
        x = self.norm(h, w.post_norm)
        if w.mlp is not None:
            return self.round(h + self.experts(w.mlp, x))
        sites = tuple(self.site(layer, f"mlp.{p}_proj") for p in ("gate", "up", "down"))
        return self.round(h + self.swiglu(x, w.gate, w.up, w.down, sites))

    def experts(self, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts MLP (HF's modules: a router `gate`, fused `experts`, maybe
        `shared_experts`): the router's logits by `dot`, the experts chosen and weighed by the
        family's `invariant_route`, each chosen expert run on its rows by `dot`, and the
        weighted outputs added slot by slot in order, so a row's result is its own."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        logits = self.linear(rows, served(mlp.gate))
        chosen, weights = self.family.invariant_route(mlp.gate, logits)
        if self.choose is not None:  # the rows flattened [B, T], as routing replay numbers them
            layer = next(i for i, m in enumerate(self.moe_mlps()) if m is mlp)
            replayed = self.choose(layer, chosen)
            if replayed is not chosen:
                chosen, weights = self.family.invariant_route(mlp.gate, logits, replayed)
        if self.record_routes:
            self._routes.append(chosen.view(*shape[:-1], -1))
        gate_up = served_param(mlp.experts, "gate_up_proj")
        down = served_param(mlp.experts, "down_proj")
        width = down.shape[-1]
        out = torch.zeros_like(rows)
        for slot in range(chosen.shape[1]):
            y = torch.zeros_like(rows)
            for e in chosen[:, slot].unique().tolist():
                at = (chosen[:, slot] == e).nonzero().squeeze(1)
                fused = gate_up[e]
                part = self.swiglu(rows[at], fused[:width], fused[width:], down[e])
                y = y.index_copy(0, at, part)
            out = self.round(out + self.round(weights[:, slot : slot + 1] * y))
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:
            out = self.round(out + self.swiglu(rows, *_mlp_weights(shared)))
        return out.view(shape)

    # ------------------------------------------------------------------ the whole model
    def head(self, h: torch.Tensor) -> torch.Tensor:
        norm, out = self.head_weights()
        return self.linear(self.norm(h, norm), out, None if self.lora is None else "lm_head")

    def logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[torch.Tensor] | None = None,
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of `ids` at `positions` ([B, T]); with a slot KV cache (`kv`: one
        tensor per layer, `slots`: each row's), the keys of earlier positions come from it."""
        h = self.round(self.embed(ids))
        self._routes = []
        for i, layer in enumerate(self.decoder_layers()):
            h = self.layer(layer, h, positions, None if kv is None else (kv[i], slots))
        self.last_routes = torch.stack(self._routes, dim=2) if self._routes else None
        return self.head(h)

    # ------------------------------------------------------------------ the trainer's forward
    def install(self) -> None:
        """Makes `model(input_ids=...)` (a trainer's forward of right-padded sequences starting
        at position 0) compute its logits by this forward. Each decoder layer is still called as
        a module, so wrappers acting around a layer's forward (FSDP2's unshard and gradient
        hooks) work as before."""
        inv = self
        for layer in self.decoder_layers():
            layer.forward = types.MethodType(
                lambda module, h, positions: inv.layer(module, h, positions), layer
            )

        def forward(model, input_ids: torch.Tensor, **_: Any) -> Any:
            b, t = input_ids.shape
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
            h = inv.round(inv.embed(input_ids))
            for layer in inv.decoder_layers():
                h = layer(h, positions)
            return inv.wrap(inv.head(h))

        self.model.forward = types.MethodType(forward, self.model)

    def wrap(self, logits: torch.Tensor) -> Any:
        """What the model's forward returns (HF: an output with `.logits`)."""
        return types.SimpleNamespace(logits=logits)


class MegatronInvariantQwen3(InvariantQwen3):
    """The same forward over a Megatron `GPTModel` of one tensor-parallel and pipeline rank: q, k
    and v are row slices of `linear_qkv` (interleaved by query group), gate and up the halves
    of `linear_fc1`; its forward returns the logits tensor, as `GPTModel`'s does."""

    def __init__(self, model: torch.nn.Module, hf_config: dict[str, Any]):
        super().__init__(model, types.SimpleNamespace(**hf_config))

    def decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.decoder.layers)

    def weights(self, layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attention, layer.mlp
        qkv = attn.linear_qkv.weight
        per_q = self.heads // self.kv_heads * self.head_dim
        grouped = qkv.view(self.kv_heads, per_q + 2 * self.head_dim, qkv.shape[-1])
        q, k, v = grouped.split([per_q, self.head_dim, self.head_dim], dim=1)
        gate, up = mlp.linear_fc1.weight.chunk(2)
        return LayerWeights(
            layer.input_layernorm.weight,
            q.reshape(-1, qkv.shape[-1]),
            k.reshape(-1, qkv.shape[-1]),
            v.reshape(-1, qkv.shape[-1]),
            attn.q_layernorm.weight,
            attn.k_layernorm.weight,
            attn.linear_proj.weight,
            layer.pre_mlp_layernorm.weight,
            gate,
            up,
            mlp.linear_fc2.weight,
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embedding.word_embeddings(ids).float()

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.model.decoder.final_layernorm.weight,
            self.model.shared_embedding_or_output_weight(),
        )

    def wrap(self, logits: torch.Tensor) -> Any:
        return logits
