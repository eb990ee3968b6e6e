"""Which tensors of a model a precision format quantizes, and the checkpoint tensors they
become: `QuantPlan` = a format (`rollout.precision`) + the keep-list (`precision.keep_bf16`).

Everything that moves or serves weights goes through one plan: `export` turns HF-named float
tensors into what a push carries and a checkpoint stores (a quantized weight's parts stay in
one bucket; NVFP4's gate waits for its up, so the pair is quantized with one amax), `layout`
is what an engine holds, `dequantize` what it computes with, `fake_quantize` what QAT does.

Routed experts held as fused 3-D tensors (HF's `mlp.experts.gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I]) are quantized as the 2-D weights a saved checkpoint and SGLang name them
(`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`): one set of scales per expert and
projection, the pushed parts under those names."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from miles_core.precision.format import WeightFormat, build_format, fake_quantize
from miles_core.precision.keep import KeepList, is_linear_weight

Bucket = list[tuple[str, torch.Tensor]]
_GATE, _UP = "gate_proj.weight", "up_proj.weight"
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Piece:
    """A 2-D weight inside a fused expert tensor: rows [start, stop) of expert `expert`."""

    name: str
    expert: int
    start: int
    stop: int


def pieces(name: str, shape: tuple[int, ...]) -> list[Piece] | None:
    """The per-expert weights a fused 3-D expert tensor holds (None: not one)."""
    m = _FUSED.match(name)
    if m is None or len(shape) != 3:
        return None
    base, experts, rows = m.group(1), shape[0], shape[1]
    out = []
    for e in range(experts):
        if m.group(2) == "gate_up_proj":
            half = rows // 2
            out.append(Piece(f"{base}.{e}.gate_proj.weight", e, 0, half))
            out.append(Piece(f"{base}.{e}.up_proj.weight", e, half, rows))
        else:
            out.append(Piece(f"{base}.{e}.down_proj.weight", e, 0, rows))
    return out


def pair_amax(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The one global amax of a gate/up pair (float32 scalar)."""
    return torch.maximum(a.float().abs().amax(), b.float().abs().amax())


def split(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`t` as 2-D weights: itself, or a fused expert tensor's per-expert pieces."""
    ps = pieces(name, tuple(t.shape))
    return [(name, t)] if ps is None else [(p.name, t[p.expert, p.start : p.stop]) for p in ps]


def prefix_of(name: str) -> str:
    """`a.b.weight` → `a.b.` (a part's name is the prefix + the part)."""
    return name[: -len("weight")]


def partner(name: str) -> str | None:
    """The other half of a gate/up pair (None: not one)."""
    if name.endswith(_GATE):
        return name[: -len(_GATE)] + _UP
    if name.endswith(_UP):
        return name[: -len(_UP)] + _GATE
    return None


@dataclass(frozen=True)
class QuantPlan:
    fmt: WeightFormat
    keep: KeepList
    spec: dict = field(default_factory=dict, compare=False)  # as JSON (`spec_of`)

    @staticmethod
    def spec_of(config) -> dict | None:
        """The run's precision as JSON (what engine servers are started with); None: none."""
        r = config.rollout
        if not build_format(r.precision, r.precision_options).quantizes:
            return None
        return {
            "format": r.precision,
            "options": r.precision_options.model_dump(),
            "keep_bf16": config.precision.keep_bf16.model_dump(),
        }

    @classmethod
    def from_spec(cls, spec: dict | None, layers: int) -> QuantPlan | None:
        if not spec:
            return None
        from miles_core.config.precision import KeepBF16

        fmt = build_format(spec["format"], spec.get("options") or {})
        return cls(fmt, KeepList.of(KeepBF16.model_validate(spec["keep_bf16"]), layers), spec)

    @classmethod
    def of(cls, config, layers: int) -> QuantPlan | None:
        """The run's plan (None: rollout.precision none)."""
        return cls.from_spec(cls.spec_of(config), layers)

    @property
    def name(self) -> str:
        return self.fmt.name

    def quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        return is_linear_weight(name, tuple(shape)) and not self.keep.keeps_hf(name)

    def _shapes_2d(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, int]]]:
        ps = pieces(name, tuple(shape))
        if ps is None:
            return [(name, tuple(shape))]
        return [(p.name, (p.stop - p.start, shape[2])) for p in ps]

    def refused(self, shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """Why this plan cannot apply to a model with these HF tensor shapes (empty: it can)."""
        out = self.keep.refused(list(shapes))
        weights: dict[str, list[str]] = {}  # reason → the weights it refuses
        for name, shape in shapes.items():
            if not self.quantized(name, shape):
                continue
            why = next(
                (w for _, s in self._shapes_2d(name, shape) if (w := self.fmt.refuses(s))), None
            )
            if why is not None:
                weights.setdefault(why, []).append(name)
        for why, names in weights.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.append(f"rollout.precision {self.name}: {why} ({names[0]}{more})")
        if not any(self.quantized(n, s) for n, s in shapes.items()):
            out.append(
                f"rollout.precision {self.name}: precision.keep_bf16 keeps every linear weight "
                "of the model; nothing would be quantized"
            )
        return out

    def layout(
        self, tensors: dict[str, torch.Tensor]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name → (shape, dtype) of what an engine holding `tensors` (its HF parameters) is
        pushed: a quantized weight's parts, every other tensor as it is."""
        out = {}
        for name, t in tensors.items():
            if self.quantized(name, t.shape):
                for piece, shape in self._shapes_2d(name, tuple(t.shape)):
                    p = prefix_of(piece)
                    out.update({p + k: v for k, v in self.fmt.parts(shape).items()})
            else:
                out[name] = (tuple(t.shape), t.dtype)
        return out

    def ignored_modules(self, shapes: dict[str, tuple[int, ...]], tied: bool) -> list[str]:
        """The linear modules left unquantized (a checkpoint's `modules_to_not_convert`)."""
        kept = [
            n.rsplit(".", 1)[0]  # a.b.weight → a.b; a fused mlp.experts.x → mlp.experts
            for n, s in shapes.items()
            if is_linear_weight(n, tuple(s)) and not self.quantized(n, s)
        ]
        kept = list(dict.fromkeys(kept))
        if tied and "lm_head" not in kept:
            kept.append("lm_head")  # the embedding, shared
        return sorted(kept)

    # ------------------------------------------------------------------ converting
    def _quantize(self, named: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The parts of the quantized weights in `named` (pairs complete), as (name, tensor)."""
        for name, w in named.items():
            amax = None
            other = partner(name)
            if self.fmt.shares_amax and other in named:
                amax = pair_amax(w, named[other])
            p = prefix_of(name)
            for part, t in self.fmt.quantize(w, amax).items():
                yield p + part, t

    def export_buckets(
        self, buckets: Iterable[Bucket], dtype: torch.dtype | None = None
    ) -> Iterator[Bucket]:
        """Buckets of HF-named float tensors → buckets of what a push carries: quantized
        weights as their parts (from the float values), other tensors rounded to `dtype` if
        given. A gate/up pair of a shared-amax format is held until both halves are in."""
        waiting: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            out: Bucket = []
            ready: dict[str, torch.Tensor] = {}
            quantized = []
            for name, t in bucket:
                if self.quantized(name, t.shape):
                    quantized += split(name, t)
                else:
                    out.append((name, t if dtype is None else t.to(dtype)))
            for name, t in quantized:
                other = partner(name)
                if self.fmt.shares_amax and other is not None and other not in ready:
                    if other in waiting:
                        ready[other] = waiting.pop(other)
                    else:
                        waiting[name] = t
                        continue
                ready[name] = t
            out.extend(self._quantize(ready))
            if out:
                yield out
        if waiting:  # a half whose partner never came (a model without one): on its own
            yield list(self._quantize(waiting))

    def export(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A whole state dict → the checkpoint's tensors (parts of quantized weights)."""
        return {n: t for b in self.export_buckets([list(named)]) for n, t in b}

    def _dequantize_2d(self, parts: dict[str, torch.Tensor], name: str, shape) -> torch.Tensor:
        p = prefix_of(name)
        return self.fmt.dequantize({k: parts[p + k] for k in self.fmt.parts(shape)})

    def dequantize(
        self, parts: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The float32 weight `name` of `shape` the parts (by full name) stand for."""
        ps = pieces(name, tuple(shape))
        if ps is None:
            return self._dequantize_2d(parts, name, tuple(shape))
        out = torch.empty(shape, dtype=torch.float32)
        for p in ps:
            out[p.expert, p.start : p.stop] = self._dequantize_2d(
                parts, p.name, (p.stop - p.start, shape[2])
            )
        return out

    def parts_of(self, name: str, shape: tuple[int, ...]) -> list[str]:
        return [
            prefix_of(piece) + k
            for piece, s in self._shapes_2d(name, tuple(shape))
            for k in self.fmt.parts(s)
        ]

    def fake_quantize(self, name: str, w: torch.Tensor, partner_w=None) -> torch.Tensor:
        """What QAT computes with for weight `name`: the values its pushed parts stand for, in
        `w`'s dtype, the gradient passing straight through (`partner_w`: a shared-amax
        format's other half of a gate/up pair)."""
        ps = pieces(name, tuple(w.shape))
        if ps is None:
            amax = None
            if partner_w is not None:
                amax = pair_amax(w.detach(), partner_w.detach())
            return fake_quantize(w, self.fmt, amax)
        rows = []
        for e in range(w.shape[0]):
            mine = [p for p in ps if p.expert == e]
            amax = None
            if self.fmt.shares_amax and len(mine) == 2:  # gate and up of one expert
                amax = w[e].detach().float().abs().amax()
            rows.append(torch.cat([fake_quantize(w[e, p.start : p.stop], self.fmt, amax)
                                   for p in mine]))  # fmt: skip
        return torch.stack(rows)
