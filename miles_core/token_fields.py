"""Per-token fields: named arrays that travel with a sample's tokens, each declared once.

A `TokenField` says everything the pipeline needs to carry one kind of per-token data (routed
experts for routing replay, teacher log-probs for distillation, quantization scales, ...) from an
engine response to the trainer's micro-batch, with no per-field code anywhere on the way:

- `name`, `dtype` (a numpy dtype name) and `shape` (per token: `()` for a scalar, `(layers, k)`
  for routed experts): an array of the field is `[rows, *shape]` of that dtype;
- `wire_key` and `encoding`: where the engine puts it in a `/generate` response's `meta_info`
  (`list`: nested JSON lists; `base64`: the raw little-endian bytes, as SGLang sends an MoE
  model's routes);
- `align`: `response` — one row per response token (row i belongs to response token i);
  `sequence` — one row per input position but the last (`len(tokens) - 1` rows: row j was
  computed while the model processed token j, SGLang's layout for routed experts);
- `fill`: the value of the rows a session adds between turns (observation / prompt tokens the
  engine did not generate; `response` fields only: a `sequence` field gets them from the next
  turn's prefill);
- `pad`: the value of padding rows in a micro-batch;
- `request_flag`: the `/generate` request key that asks an engine for the field (empty: the
  field does not come from the engine);
- `from_model`: for a field whose shape depends on the model (routed experts: its MoE layers and
  top_k), the overrides `for_model(hf_config)` applies; such a declaration is a template, bound
  to the run's model when the run starts (`declare_for_model`).

Joining is the same for every field (`join`): a continuation after a pause-abort appends its
rows; a session turn appends `fill` rows for the appended tokens, then its own rows.

Fields are registered by name (`FIELDS.register(name, field)`); a run's are named by import path
in `rollout.token_fields` (`load_token_fields` checks and registers them; a template is
registered once bound to the model).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from miles_core.plugins import Registry

Align = Literal["response", "sequence"]
Encoding = Literal["list", "base64"]
_LITTLE = "<"  # wire and checkpoint byte order


@dataclass(frozen=True)
class TokenField:
    name: str
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    wire_key: str = ""  # meta_info key; default: the name
    encoding: Encoding = "list"
    align: Align = "response"
    fill: float = 0
    pad: float = 0
    # values must lie in [low, high) when given (routed experts: [0, experts)): a record from
    # another model is refused rather than trained on
    bounds: tuple[float, float] | None = None
    description: str = field(default="", compare=False)
    request_flag: str = ""  # the engine request key that asks for it ("": not the engine's)
    # a template's per-model overrides (shape, bounds) from the model's HF config (a dict)
    from_model: Callable[[dict[str, Any]], dict[str, Any]] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"token field name {self.name!r} must be an identifier")
        try:
            kind = np.dtype(self.dtype).kind
        except TypeError:
            raise ValueError(f"token field {self.name}: unknown dtype {self.dtype!r}") from None
        if kind not in "biuf":
            raise ValueError(
                f"token field {self.name}: dtype {self.dtype!r} is not numeric (bool, int, float)"
            )
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or d <= 0 for d in shape):
            raise ValueError(f"token field {self.name}: shape {shape} needs positive ints")
        if self.encoding not in ("list", "base64"):
            raise ValueError(f"token field {self.name}: unknown encoding {self.encoding!r}")
        if self.align not in ("response", "sequence"):
            raise ValueError(f"token field {self.name}: unknown align {self.align!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "wire_key", self.wire_key or self.name)
        if self.bounds is not None:
            object.__setattr__(self, "bounds", tuple(self.bounds))

    # ------------------------------------------------------------------ declarations
    def bound(self, **changes: Any) -> TokenField:
        """This declaration with `changes`, no longer a template."""
        return replace(self, from_model=None, **changes)

    def for_model(self, hf_config: dict[str, Any]) -> TokenField:
        """The declaration for a model (a template's shape and bounds from its HF config);
        ValueError when the model cannot have the field."""
        return self if self.from_model is None else self.bound(**self.from_model(hf_config))

    def declaration(self) -> dict[str, Any]:
        """This bound declaration as JSON values (how a run hands it to its servers and ranks)."""
        if self.from_model is not None:
            raise ValueError(f"token field {self.name} is a template: bind it to a model first")
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "from_model"}
        return {**out, "shape": list(self.shape), "bounds": self.bounds and list(self.bounds)}

    # ------------------------------------------------------------------ arrays
    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def empty(self) -> np.ndarray:
        return np.zeros((0, *self.shape), dtype=self.np_dtype)

    def array(self, value: Any) -> np.ndarray:
        """`value` as this field's array `[rows, *shape]` (a copy; raises on a wrong shape)."""
        arr = np.array(value, dtype=self.np_dtype)
        if arr.size == 0:
            return self.empty()
        if arr.shape[1:] != self.shape:
            raise ValueError(
                f"token field {self.name}: rows of shape {arr.shape[1:]}, declared {self.shape}"
            )
        return arr

    def rows(self, n_tokens: int, response_length: int) -> int:
        """The rows a sample of `n_tokens` tokens (`response_length` of them generated) holds."""
        return response_length if self.align == "response" else max(n_tokens - 1, 0)

    def join(self, prev: np.ndarray | None, new: np.ndarray, appended: int = 0) -> np.ndarray:
        """`prev` (the trajectory so far) extended by the rows of a later generation call.

        `response`: prev + `appended` fill rows (tokens added between session turns) + new.
        `sequence`: `new` covers the call's whole input, so prev + the rows of `new` past it."""
        if prev is None:
            prev = self.empty()
        if self.align == "sequence":
            if len(new) < len(prev):
                raise ValueError(
                    f"token field {self.name}: a later call returned {len(new)} rows, fewer "
                    f"than the {len(prev)} the trajectory already has"
                )
            return np.concatenate([prev, new[len(prev) :]])
        gap = np.full((appended, *self.shape), self.fill, dtype=self.np_dtype)
        return np.concatenate([prev, gap, new])

    # ------------------------------------------------------------------ engine wire format
    def decode(self, raw: Any) -> np.ndarray:
        """The field's array from its `meta_info` value."""
        if self.encoding == "base64":
            if not isinstance(raw, str):
                raise ValueError(f"token field {self.name}: base64 payload expected")
            data = base64.b64decode(raw)
            row = self.np_dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
            if len(data) % row:
                raise ValueError(
                    f"token field {self.name}: {len(data)} bytes are not whole rows of "
                    f"{self.shape} {self.dtype}"
                )
            buf = np.frombuffer(data, dtype=self.np_dtype.newbyteorder(_LITTLE))
            return buf.astype(self.np_dtype).reshape(-1, *self.shape)
        return self.array(raw)

    def encode(self, arr: np.ndarray) -> Any:
        """The `meta_info` value of an array (what an engine that emits this field sends)."""
        arr = self.array(arr)
        if self.encoding == "base64":
            return _b64(arr)
        return arr.tolist()

    # ------------------------------------------------------------------ JSON (checkpoints)
    def to_json(self, arr: np.ndarray) -> dict[str, Any]:
        """Exact: the raw bytes, whatever the encoding on the wire."""
        arr = self.array(arr)
        return {"rows": int(arr.shape[0]), "data": _b64(arr)}

    def from_json(self, data: dict[str, Any]) -> np.ndarray:
        raw = base64.b64decode(data["data"])
        buf = np.frombuffer(raw, dtype=self.np_dtype.newbyteorder(_LITTLE))
        return buf.astype(self.np_dtype).reshape(int(data["rows"]), *self.shape)


def _b64(arr: np.ndarray) -> str:
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder(_LITTLE))
    return base64.b64encode(little.tobytes()).decode("ascii")


# ---------------------------------------------------------------------- registry
def _declare(obj: Any, name: str) -> TokenField:
    """What registering a field checks: a TokenField under its own name, declared once (the same
    declaration again is a no-op), its meta_info key no other field's. A template (a field whose
    shape the model sets) passes as it is: only its bound form is registered."""
    if not isinstance(obj, TokenField):
        raise ValueError(f"token field {name!r} is a {type(obj).__name__}, not a TokenField")
    if obj.from_model is not None:
        return obj
    if ":" not in name and obj.name != name:  # (an import path is declared under its name)
        raise ValueError(f"token field {obj.name!r} registered under another name, {name!r}")
    old = FIELDS.get(obj.name) if obj.name in FIELDS else None
    if old is not None and old != obj:
        raise ValueError(f"token field {obj.name!r} is already declared differently: {old}")
    clash = next(
        (o for o in FIELDS.values() if o.wire_key == obj.wire_key and o.name != obj.name), None
    )
    if clash is not None:
        raise ValueError(
            f"token field {obj.name!r}: meta_info key {obj.wire_key!r} is field {clash.name!r}'s"
        )
    return obj


FIELDS: Registry[TokenField] = Registry(
    "token field", "rollout.token_fields", example="pkg.mod:NAME", load=_declare
)
"""Declared fields: `FIELDS.register(field.name, field)` beside the declaration."""


def token_field(name: str) -> TokenField:
    """The declared field `name`; KeyError naming the declared ones otherwise."""
    if name not in FIELDS:
        known = ", ".join(FIELDS.names()) or "none"
        raise KeyError(
            f"no token field named {name!r} is declared (declared: {known}); register it with "
            "FIELDS.register or load it by import path (pkg.mod:FIELD)"
        )
    return FIELDS.get(name)


def _imported(path: str) -> TokenField:
    if ":" not in path:
        raise ValueError(f"token field {path!r}: expected an import path pkg.mod:NAME")
    return FIELDS.get(path)  # imported and checked; a template is not registered


def load_token_fields(paths: Iterable[str]) -> list[TokenField]:
    """Imports each `pkg.mod:NAME` (a TokenField) and declares it under its name (a template
    waits for the model: `declare_for_model`)."""
    out = []
    for path in paths:
        f = _imported(path)
        out.append(f if f.from_model is not None else FIELDS.register(f.name, f))
    return out


def declare_for_model(paths: Iterable[str], hf_config: dict[str, Any]) -> list[TokenField]:
    """Declares the fields at `paths` for a model (a template bound to its HF config, in place of
    another model's declaration); ValueError naming the path when the model cannot have one."""
    out = []
    for path in paths:
        try:
            f = _imported(path).for_model(hf_config)
        except ValueError as e:
            raise ValueError(f"rollout.token_fields {path}: {e}") from None
        out.append(_redeclare(f))
    return out


def declared_field(raw: str | dict[str, Any]) -> TokenField:
    """Declares the field of a `TokenField.declaration` form (a JSON string or its dict); ValueError
    when it is not one."""
    try:
        data = json.loads(raw) if isinstance(raw, str) else dict(raw)
        f = TokenField(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a token field declaration ({e}): {str(raw)[:200]}") from None
    return _redeclare(f)


def _redeclare(f: TokenField) -> TokenField:
    """Declares `f` in place of a declaration of its name for another model."""
    if f.name in FIELDS and FIELDS.get(f.name) != f:
        FIELDS.unregister(f.name)
    return FIELDS.register(f.name, f)


def requested(paths: Iterable[str]) -> list[str]:
    """The names of the fields at `paths` that an engine is asked for (a request flag)."""
    return [f.name for f in map(_imported, paths) if f.request_flag]


# ---------------------------------------------------------------------- generic helpers
def decode_meta(meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """The declared fields present in an engine response's `meta_info` extras."""
    return {f.name: f.decode(meta[f.wire_key]) for f in FIELDS.values() if f.wire_key in meta}


def check_lengths(fields: dict[str, np.ndarray], n_tokens: int, response_length: int) -> None:
    """Raises ValueError naming the first field whose rows do not match the tokens (or whose
    values leave its bounds)."""
    for name, arr in fields.items():
        f = token_field(name)
        want = f.rows(n_tokens, response_length)
        if not isinstance(arr, np.ndarray) or arr.shape != (want, *f.shape):
            got = getattr(arr, "shape", type(arr).__name__)
            raise ValueError(
                f"token field {name} ({f.align}-aligned) has shape {got}, expected "
                f"{(want, *f.shape)} for {n_tokens} tokens of which {response_length} generated"
            )
        if f.bounds is not None and arr.size:
            low, high = f.bounds
            if arr.min() < low or arr.max() >= high:
                raise ValueError(
                    f"token field {name} holds values in [{arr.min()}, {arr.max()}], outside "
                    f"[{low:g}, {high:g})"
                )


def fields_to_json(fields: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: token_field(name).to_json(arr) for name, arr in fields.items()}


def fields_from_json(data: dict[str, Any] | None) -> dict[str, np.ndarray]:
    return {name: token_field(name).from_json(v) for name, v in (data or {}).items()}


def join_fields(
    prev: dict[str, np.ndarray], new: dict[str, np.ndarray], appended: int = 0
) -> dict[str, np.ndarray]:
    """`prev` extended by a later call's fields (`TokenField.join`, field by field)."""
    out = dict(prev)
    for name, arr in new.items():
        out[name] = token_field(name).join(prev.get(name), arr, appended)
    return out
