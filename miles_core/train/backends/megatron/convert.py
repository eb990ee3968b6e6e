"""HF ↔ Megatron `GPTModel` weights, both directions, and how each Megatron tensor splits
over tensor-parallel ranks. Conversion is a permutation of values (no arithmetic), so a round trip
is bitwise.

Megatron's layouts, per decoder layer:

- `self_attention.linear_qkv.weight`: q, k and v fused and interleaved by query group: for each
  of the `num_key_value_heads` groups, its query heads, then its key head, then its value head
  (rows of `head_dim`). A tensor-parallel rank holds whole groups: a dim-0 chunk.
- `mlp.linear_fc1.weight`: gate and up fused, [gate; up]. Rank r holds [gate_r; up_r].
- `self_attention.linear_proj.weight`, `mlp.linear_fc2.weight`: row-parallel, dim-1 chunks.
- `embedding.word_embeddings.weight`, `output_layer.weight`: vocabulary-parallel, dim-0 chunks of
  the vocabulary padded to a multiple of tp (the padding rows are zero and never leave).
- norms (`input_layernorm`, `pre_mlp_layernorm`, `q_layernorm`, `k_layernorm`,
  `final_layernorm`): replicated.

Names here are global (`decoder.layers.<i>` with i over the whole model); a pipeline stage holds
layers [offset, offset + layers/pp) under local indices (`stage_name` / `global_name`). Which HF
tensor each one holds is the model family's (`HFNames`, from `ModelFamily.megatron_names`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.models.check import moe_layer_indices, moe_sizes
from miles_core.train.backends.megatron.architecture import check_architecture


@dataclass(frozen=True)
class HFNames:
    """A model family's HF tensor names (`ModelFamily.megatron_names`) for each Megatron tensor;
    per-layer names are relative to `model.layers.<i>.`."""

    layer: dict[str, str]  # one HF tensor ↔ one Megatron tensor (`mlp.` ones: dense layers)
    qkv: tuple[str, str, str]  # q, k, v: fused into `QKV`
    fc1: tuple[str, str]  # gate, up: fused into `FC1`
    top: dict[str, str]  # outside the layers: embedding, final norm, output layer
    moe: dict[str, str] = field(default_factory=dict)  # an MoE layer's router, shared fc2, ...
    shared_fc1: tuple[str, ...] = ()  # the shared experts' gate, up: fused into `SHARED_FC1`
    experts: dict[str, str] = field(default_factory=dict)  # HF fused [E, ...] → local expert's

    @property
    def expert_bias(self) -> bool:
        """Whether the router has a correction bias (it chooses experts, never weighs them)."""
        return "mlp.router.expert_bias" in self.moe.values()


def back(names: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in names.items()}


@dataclass(frozen=True)
class Shapes:
    heads: int
    groups: int  # key/value heads
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    layers: int
    tied: bool
    names: HFNames  # the family's HF tensor names
    # mixture of experts (none in a dense model): routed experts, the layers that have them,
    # shared experts (GLM4-MoE: 0 or 1 fused MLP), the router's correction bias
    experts: int = 0
    moe_layers: frozenset[int] = frozenset()
    shared_experts: int = 0
    expert_bias: bool = False
    top_k: int = 0  # experts per token
    expert_ffn: int = 0  # one expert's MLP width

    @classmethod
    def of(cls, hf: Any) -> Shapes:
        """From an HF config (object or dict); refuses an architecture it cannot convert."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        names = check_architecture(d).megatron_names()
        heads = int(d["num_attention_heads"])
        layers = int(d["num_hidden_layers"])
        moe = moe_sizes(d)
        return cls(
            heads=heads,
            groups=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            hidden=int(d["hidden_size"]),
            ffn=int(d["intermediate_size"]),
            vocab=int(d["vocab_size"]),
            layers=layers,
            tied=bool(d.get("tie_word_embeddings", False)),
            names=names,
            experts=moe.get("experts", 0),
            moe_layers=frozenset(moe_layer_indices(d)) if moe else frozenset(),
            shared_experts=moe.get("shared", 0),
            expert_bias=names.expert_bias,
            top_k=int(d.get("num_experts_per_tok") or 0) if moe else 0,
            expert_ffn=moe.get("expert_size", 0),
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp

    def moe_index(self, layer: int) -> int:
        """The position of decoder layer `layer` (global, 0-based) among the MoE layers: its
        row of a routing record."""
        return sorted(self.moe_layers).index(layer)


SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)")
_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split on dim 1
QKV = "self_attention.linear_qkv.weight"
FC1 = "mlp.linear_fc1.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] (HF) → Megatron's per-group interleave; `groups` may be a rank's share."""
    cols = q.shape[-1]
    q = q.reshape(groups, -1, cols)
    k = k.reshape(groups, -1, cols)
    v = v.reshape(groups, -1, cols)
    return torch.cat([q, k, v], dim=1).reshape(-1, cols)


def split_qkv(qkv: torch.Tensor, s: Shapes, groups: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused qkv of `groups` query groups → HF (q, k, v) rows of those groups."""
    per_q = s.heads // s.groups * s.head_dim
    g = qkv.reshape(groups, per_q + 2 * s.head_dim, -1)
    q, k, v = g.split([per_q, s.head_dim, s.head_dim], dim=1)
    cols = qkv.shape[-1]
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


_SAVED_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight"
)


def fuse_saved_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF MoE checkpoint as saved (transformers writes one tensor per expert and projection:
    `experts.<e>.gate_proj.weight`, …) → the fused tensors its modules hold
    (`experts.gate_up_proj` [E, 2·width, hidden], rows [gate; up]; `experts.down_proj`
    [E, hidden, width]). A state dict already fused is returned as it is."""
    per: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        m = _SAVED_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, proj in per.items():
        experts = sorted(proj.get("down", {}))
        if any(sorted(proj.get(k, {})) != experts for k in ("gate", "up")) or experts != list(
            range(len(experts))
        ):
            raise ValueError(f"{prefix}: the checkpoint's experts are incomplete")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([proj["gate"][e], proj["up"][e]]) for e in experts]
        )
        out[prefix + ".down_proj"] = torch.stack([proj["down"][e] for e in experts])
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], s: Shapes) -> dict[str, torch.Tensor]:
    """A full HF state dict (as saved, or as the modules hold it) → full Megatron tensors
    (global layer names, vocabulary unpadded). Tied embeddings: no `output_layer.weight` (a
    pipeline's last stage takes the embedding)."""
    hf = fuse_saved_experts(hf)
    out: dict[str, torch.Tensor] = {}
    names = s.names
    known = set(names.top)
    for i in range(s.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        moe = i in s.moe_layers
        dense = {h: mc for h, mc in names.layer.items() if not moe or "mlp." not in h}
        for h, mc in dense.items():
            out[m + mc] = hf[p + h]
        out[m + QKV] = fuse_qkv(*(hf[p + h] for h in names.qkv), s.groups)
        known |= {p + h for h in (*dense, *names.qkv)}
        if not moe:
            out[m + FC1] = torch.cat([hf[p + h] for h in names.fc1])
            known |= {p + h for h in names.fc1}
            continue
        for h, mc in names.moe.items():
            if p + h in hf:
                out[m + mc] = hf[p + h]
                known.add(p + h)
        if s.shared_experts:
            out[m + SHARED_FC1] = torch.cat([hf[p + h] for h in names.shared_fc1])
            known |= {p + h for h in names.shared_fc1}
        for h, mc in names.experts.items():
            for e, t in enumerate(hf[p + h]):
                out[f"{m}mlp.experts.local_experts.{e}.{mc}"] = t
            known.add(p + h)
    for h, mc in names.top.items():
        if h == "lm_head.weight" and s.tied:
            continue
        out[mc] = hf[h]
    extra = sorted(set(hf) - known - ({"lm_head.weight"} if s.tied else set()))
    if extra:
        raise ValueError(f"HF weights the Megatron converter does not know: {extra[:5]}")
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], s: Shapes) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (global names) → the HF state dict (tied: no `lm_head.weight`)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # HF fused expert tensor → its slices
    for name, t in mc.items():
        e = expert_of(name)
        for hf_name, part in to_hf(name, t, s):
            if e is None:
                out[hf_name] = part
            else:
                experts.setdefault(hf_name, {})[e] = part
    for hf_name, parts in experts.items():
        missing = sorted(set(range(s.experts)) - set(parts))
        if missing:
            raise ValueError(f"{hf_name}: the Megatron weights lack experts {missing[:5]}")
        out[hf_name] = torch.cat([parts[e] for e in range(s.experts)])
    return out


def expert_of(name: str) -> int | None:
    """The routed expert a Megatron tensor belongs to (global name), or None."""
    m = _MC_LAYER.fullmatch(name)
    e = _EXPERT.fullmatch(m.group(2)) if m else None
    return int(e.group(1)) if e else None


def hf_names(name: str, s: Shapes) -> list[str]:
    """The HF tensors Megatron tensor `name` (global) holds, in order (tied `output_layer`:
    none, it is the embedding)."""
    names = s.names
    m = _MC_LAYER.fullmatch(name)
    if m is None:
        if name == "output_layer.weight" and s.tied:
            return []
        hf = back(names.top).get(name)
        if hf is None:
            raise ValueError(f"unknown Megatron weight {name!r}")
        return [hf]
    p = f"model.layers.{m.group(1)}."
    rest = m.group(2)
    fused = {QKV: names.qkv, FC1: names.fc1, SHARED_FC1: names.shared_fc1}
    if rest in fused:
        return [p + h for h in fused[rest]]
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:  # one slice ([e]) of the fused HF tensor
        rest = expert.group(2)
        single = back(names.experts)
    else:
        single = back(names.moe) | back(names.layer)
    if rest not in single:
        raise ValueError(f"unknown Megatron weight {name!r}")
    return [p + single[rest]]


def to_hf(
    name: str, t: torch.Tensor, s: Shapes, groups: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one Megatron tensor (global name). A tensor-parallel shard converts too:
    `groups` is then its share of query groups, and each HF tensor comes out as the rows or
    columns that shard holds (a vocabulary shard keeps its padding rows)."""
    names = hf_names(name, s)
    rest = _MC_LAYER.fullmatch(name)
    rest = rest.group(2) if rest else name
    if rest == QKV:
        parts = split_qkv(t, s, groups or s.groups)
    elif rest in (FC1, SHARED_FC1):
        parts = t.chunk(2)
    elif _EXPERT.fullmatch(rest):
        parts = (t.unsqueeze(0),)  # rows [e, e + 1) of the fused HF tensor
    elif rest in VOCAB and groups is None:
        parts = (t[: s.vocab],)  # a full tensor drops the padding
    else:
        parts = (t,)
    return list(zip(names, parts, strict=False))


def tp_dim(name: str) -> int | None:
    """The dim a Megatron tensor (global or local name) is split on across tp ranks; None:
    replicated."""
    rest = _MC_LAYER.fullmatch(name)
    rest = rest.group(2) if rest else name
    if rest in (QKV, FC1, *VOCAB):
        return 0
    if rest in ROW_PARALLEL:
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, tp: int, rank: int, s: Shapes) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of the full Megatron tensor `name`."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return full
    rest = _MC_LAYER.fullmatch(name)
    rest = rest.group(2) if rest else name
    if rest == FC1:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if rest in VOCAB:
        pad = s.padded_vocab(tp) - full.shape[0]
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
    return full.chunk(tp, dim=dim)[rank].clone()


def tp_unshard(name: str, parts: list[torch.Tensor], s: Shapes) -> torch.Tensor:
    """The full Megatron tensor from every tp rank's part, in rank order (vocabulary padding
    kept: `to_hf` drops it)."""
    dim = tp_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    rest = _MC_LAYER.fullmatch(name)
    rest = rest.group(2) if rest else name
    if rest == FC1:
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def stage_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """Global layer name → the name on the stage whose first layer is `offset` (an expert: on
    the expert-parallel rank whose first expert is `expert_offset`)."""
    m = _MC_LAYER.fullmatch(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) - offset}.{_shift_expert(m.group(2), -expert_offset)}"


def global_name(name: str, offset: int, expert_offset: int = 0) -> str:
    m = _MC_LAYER.fullmatch(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) + offset}.{_shift_expert(m.group(2), expert_offset)}"


def _shift_expert(rest: str, by: int) -> str:
    e = _EXPERT.fullmatch(rest)
    return f"mlp.experts.local_experts.{int(e.group(1)) + by}.{e.group(2)}" if e else rest


def moe_layer_names(layer: int, s: Shapes) -> list[str]:
    """The MLP tensors of MoE layer `layer` (global names) in the order weights leave: the
    router (and its correction bias), the shared experts, then every expert's fc1, every
    expert's fc2 (each HF fused tensor's rows in order)."""
    p = f"decoder.layers.{layer}.mlp."
    names = [p + "router.weight"] + ([p + "router.expert_bias"] if s.expert_bias else [])
    if s.shared_experts:
        names += [p + "shared_experts.linear_fc1.weight", p + "shared_experts.linear_fc2.weight"]
    for fc in ("linear_fc1.weight", "linear_fc2.weight"):
        names += [f"{p}experts.local_experts.{e}.{fc}" for e in range(s.experts)]
    return names


def full_shape(name: str, s: Shapes, tp: int) -> list[int]:
    """The shape of the full Megatron tensor `name` (global; vocabulary padded for `tp`)."""
    m = _MC_LAYER.fullmatch(name)
    rest = m.group(2) if m else name
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        rest = f"mlp.experts.{expert.group(2)}"
    shared = s.shared_experts * s.expert_ffn
    shapes = {
        QKV: [(s.heads + 2 * s.groups) * s.head_dim, s.hidden],
        FC1: [2 * s.ffn, s.hidden],
        "mlp.linear_fc2.weight": [s.hidden, s.ffn],
        "self_attention.linear_proj.weight": [s.hidden, s.heads * s.head_dim],
        "self_attention.q_layernorm.weight": [s.head_dim],
        "self_attention.k_layernorm.weight": [s.head_dim],
        "mlp.router.weight": [s.experts, s.hidden],
        "mlp.router.expert_bias": [s.experts],
        SHARED_FC1: [2 * shared, s.hidden],
        "mlp.shared_experts.linear_fc2.weight": [s.hidden, shared],
        "mlp.experts.linear_fc1.weight": [2 * s.expert_ffn, s.hidden],
        "mlp.experts.linear_fc2.weight": [s.hidden, s.expert_ffn],
    }
    if rest in VOCAB:
        return [s.padded_vocab(tp), s.hidden]
    return shapes.get(rest, [s.hidden])


def hf_pieces(name: str, s: Shapes, tp: int, rank: int) -> list[tuple[str, int, int, int]]:
    """Which slice of which HF tensors tp rank `rank`'s shard of Megatron tensor `name` holds:
    (hf name, dim, start, length), in `to_hf`'s order (p2p placement plans)."""
    dim = tp_dim(name)
    rest = _MC_LAYER.fullmatch(name)
    rest = rest.group(2) if rest else name
    if name == "output_layer.weight" and s.tied:
        return []
    if rest == QKV:
        q, k, v = hf_names(name, s)
        q_rows = s.heads // tp * s.head_dim
        kv_rows = s.groups // tp * s.head_dim
        return [
            (q, 0, rank * q_rows, q_rows),
            (k, 0, rank * kv_rows, kv_rows),
            (v, 0, rank * kv_rows, kv_rows),
        ]
    names = hf_names(name, s)
    e = expert_of(name)
    if e is not None:
        return [(names[0], 0, e, 1)]  # its expert's row of the fused HF tensor
    if dim is None:  # whole (-1 stands for the full length); a shared fc1: gate and up
        return [(n, 0, 0, -1) for n in names]
    if rest == FC1:
        rows = s.ffn // tp
        return [(n, 0, rank * rows, rows) for n in names]
    if rest in VOCAB:
        rows = s.padded_vocab(tp) // tp
        start = min(rank * rows, s.vocab)
        return [(names[0], 0, start, min(rows, s.vocab - start))]
    cols = (s.heads * s.head_dim if rest == ROW_PARALLEL[0] else s.ffn) // tp
    return [(names[0], 1, rank * cols, cols)]
