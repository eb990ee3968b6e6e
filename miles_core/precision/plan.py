"""Which tensors of a model a precision format quantizes, and the checkpoint tensors they
become: `QuantPlan` = a format (`rollout.precision`) + the keep-list (`precision.keep_bf16`).

Everything that moves or serves weights goes through one plan: `export` turns HF-named float
tensors into what a push carries and a checkpoint stores (a quantized weight's parts stay in
one bucket; NVFP4's gate waits for its up, so the pair is quantized with one amax), `layout`
is what an engine holds, `dequantize` what it computes with."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from miles_core.precision.format import WeightFormat, build_format
from miles_core.precision.keep import KeepList, is_linear_weight

Bucket = list[tuple[str, torch.Tensor]]
_GATE, _UP = "gate_proj.weight", "up_proj.weight"


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
        return cls(fmt, KeepList.of(KeepBF16.model_validate(spec["keep_bf16"]), layers))

    @classmethod
    def of(cls, config, layers: int) -> QuantPlan | None:
        """The run's plan (None: rollout.precision none)."""
        return cls.from_spec(cls.spec_of(config), layers)

    @property
    def name(self) -> str:
        return self.fmt.name

    def quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        return is_linear_weight(name, tuple(shape)) and not self.keep.keeps_hf(name)

    def refused(self, shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """Why this plan cannot apply to a model with these HF tensor shapes (empty: it can)."""
        out = self.keep.refused(list(shapes))
        weights: dict[str, list[str]] = {}  # reason → the weights it refuses
        for name, shape in shapes.items():
            if not self.quantized(name, shape):
                continue
            why = self.fmt.refuses(tuple(shape))
            if why is not None and len(shape) == 3:
                why += "; keep the routed experts with precision.keep_bf16.modules: [experts]"
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
                p = prefix_of(name)
                out.update({p + k: v for k, v in self.fmt.parts(tuple(t.shape)).items()})
            else:
                out[name] = (tuple(t.shape), t.dtype)
        return out

    def ignored_modules(self, shapes: dict[str, tuple[int, ...]], tied: bool) -> list[str]:
        """The linear modules left unquantized (a checkpoint's `modules_to_not_convert`)."""
        kept = [
            prefix_of(n).rstrip(".")
            for n, s in shapes.items()
            if is_linear_weight(n, tuple(s)) and not self.quantized(n, s)
        ]
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
                amax = torch.maximum(w.float().abs().amax(), named[other].float().abs().amax())
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
            for name, t in bucket:
                if not self.quantized(name, t.shape):
                    out.append((name, t if dtype is None else t.to(dtype)))
                    continue
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

    def dequantize(self, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The float32 weight `name` the parts (by full name) stand for."""
        p = prefix_of(name)
        return self.fmt.dequantize({k[len(p) :]: v for k, v in parts.items() if k.startswith(p)})

    def parts_of(self, name: str, shape: tuple[int, ...]) -> list[str]:
        p = prefix_of(name)
        return [p + k for k in self.fmt.parts(tuple(shape))]
