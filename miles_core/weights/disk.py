"""Disk transport: each push is a safetensors checkpoint under an fsspec root (a local path, or
s3://… for engines on other hosts), which the engines load with `/update_weights_from_disk`.

Layout: `<root>/weight_v{version:06d}/model.safetensors` + `manifest.json` ({"version", "kind":
full | delta, "tensors": {name: sha256 of the final raw bytes}}). With `delta`, every push after
the first holds only the tensors that changed, encoded against the previous push (weights/delta.py;
the manifest names `base_version` and each encoded tensor's encoding, dtype and shape).
The engine verifies every tensor against the manifest before loading, so a corrupt, mismatched
or out-of-order file is refused and the engine keeps its weights. The only pause is the engine's
own load (between two scheduler steps); the write overlaps generation. Older versions are
removed, keeping `keep` of them.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib

import fsspec
import torch
from safetensors.torch import load, save

from miles_core.engine_api import DISK, EngineRequestRejected, ProcessUnavailable
from miles_core.weights import delta
from miles_core.weights.remote import PushFailed, check_reachable
from miles_core.weights.source import TrainerWeights
from miles_core.weights.transport import PushStats, TransportBase, register_transport

MANIFEST = "manifest.json"


def tensor_sha256(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def version_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/weight_v{version:06d}"


def load_weight_dir(
    path: str,
    storage_options: dict | None = None,
    current: dict[str, torch.Tensor] | None = None,
    current_version: int | None = None,
) -> dict[str, torch.Tensor]:
    """Reads every *.safetensors file of a directory (local or fsspec URL), or one file. With a
    manifest, each tensor's sha256 must match it and the names must be exactly its names. A
    delta is decoded against `current` (the engine's weights), which must be at its base
    version; it returns only the changed tensors."""
    fs, base = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if fs.isdir(base):
        files = sorted(f for f in fs.ls(base, detail=False) if f.endswith(".safetensors"))
    else:
        files = [base] if fs.exists(base) else []
    if not files:
        raise FileNotFoundError(f"no safetensors weights at {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with fs.open(f, "rb") as fh:
            tensors.update(load(fh.read()))
    manifest_path = f"{base}/{MANIFEST}"
    if fs.isdir(base) and fs.exists(manifest_path):
        with fs.open(manifest_path, "r") as fh:
            manifest = json.load(fh)
        expected = manifest["tensors"]
        if manifest.get("kind") == "delta":
            tensors = _apply_delta(path, manifest, tensors, current, current_version)
        if set(expected) != set(tensors):
            raise ValueError(
                f"{path}: tensors do not match the manifest "
                f"(missing {sorted(set(expected) - set(tensors))[:3]}, "
                f"extra {sorted(set(tensors) - set(expected))[:3]})"
            )
        for name, t in tensors.items():
            if tensor_sha256(t) != expected[name]:
                raise ValueError(f"{path}: checksum mismatch for {name}; the file is corrupt")
    return tensors


def _apply_delta(path, manifest, packed, current, current_version) -> dict[str, torch.Tensor]:
    if current is None:
        raise ValueError(f"{path} is a delta; it needs the engine's current weights")
    unknown = {s.get("encoding") for s in manifest["encoded"].values()} - set(delta.ENCODINGS)
    if unknown:
        raise ValueError(f"{path}: unknown delta encoding {sorted(map(str, unknown))}")
    if current_version != manifest["base_version"]:
        raise ValueError(
            f"{path} is a delta from version {manifest['base_version']}, but this engine is at "
            f"version {current_version}: push the full weights (or the missing deltas) first"
        )
    out = {}
    for name, spec in manifest["encoded"].items():
        old = current.get(name)
        if old is None or list(old.shape) != spec["shape"] or name not in packed:
            raise ValueError(f"{path}: delta tensor {name} does not fit this model")
        # pushes may be in a narrower dtype than the engine keeps (bf16 into fp32): the base is
        # the engine's tensor in the pushed dtype, exact when the engine loaded that push; the
        # sha256 below catches any other base
        old = old.to(getattr(torch, spec["dtype"]))
        try:
            out[name] = delta.decode(packed[name], old, spec["encoding"])
        except (ValueError, zlib.error) as e:
            raise ValueError(f"{path}: checksum mismatch for {name}; the delta is corrupt") from e
    return out


class DiskTransport(TransportBase):
    route = DISK
    name = "disk"

    def __init__(
        self,
        root: str = "weights",
        storage_options: dict | None = None,
        keep: int = 2,
        delta: bool = False,
        **options,
    ):
        super().__init__(**options)
        self.delta = delta
        self._base: dict[str, torch.Tensor] | None = None  # the last pushed weights (delta)
        self._base_version = 0
        self.root = root
        self.storage_options = storage_options or {}
        self.keep = keep
        self._written: list[str] = []

    def connect(self, engines: list) -> None:
        super().connect(engines)
        self._base = None  # a freshly connected engine (e.g. a replaced one): the next push is full

    def _fits_base(self, tensors: dict[str, torch.Tensor]) -> bool:
        """A delta needs the same names, shapes and dtypes as the last push (else: full)."""
        base = self._base
        return (
            base is not None
            and base.keys() == tensors.keys()
            and all(
                base[n].dtype == t.dtype and base[n].shape == t.shape for n, t in tensors.items()
            )
        )

    def push(self, source: TrainerWeights, version: int, pause_mode: str = "abort") -> PushStats:
        t0 = time.perf_counter()
        tensors = {n: t.detach().cpu().contiguous() for b in self.buckets(source) for n, t in b}
        path = version_dir(self.root, version)
        fs, base = fsspec.core.url_to_fs(path, **self.storage_options)
        fs.makedirs(base, exist_ok=True)
        manifest: dict = {
            "version": version,
            "kind": "full",
            "tensors": {n: tensor_sha256(t) for n, t in tensors.items()},
        }
        payload = tensors
        if self.delta and self._fits_base(tensors):
            changed = {  # compared as bytes: torch.equal treats -0.0 == 0.0
                n: t
                for n, t in tensors.items()
                if not torch.equal(t.view(torch.uint8), self._base[n].view(torch.uint8))
            }
            encoded = {n: delta.encode(t, self._base[n]) for n, t in changed.items()}
            payload = {n: blob for n, (_, blob) in encoded.items()}
            manifest.update(
                kind="delta",
                base_version=self._base_version,
                encoded={
                    n: {
                        "encoding": encoded[n][0],
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                    }
                    for n, t in changed.items()
                },
                tensors={n: manifest["tensors"][n] for n in changed},
            )
        data = save(payload, metadata={"version": str(version)})
        with fs.open(f"{base}/model.safetensors", "wb") as f:
            f.write(data)
        with fs.open(f"{base}/{MANIFEST}", "w") as f:
            json.dump(manifest, f)
        check_reachable(self.engines)
        for e in self.engines:
            try:
                e.update_weights_from_disk(path, version)
            except (ProcessUnavailable, EngineRequestRejected) as err:
                raise PushFailed(f"engine at {e.url} did not load {path}: {err}") from err
        if self.delta:
            self._base = {n: t.clone() for n, t in tensors.items()}
            self._base_version = version
        if path not in self._written:  # a replaced engine gets the current version again
            self._written.append(path)
        while len(self._written) > self.keep:
            old = self._written.pop(0)
            fs.rm(fsspec.core.url_to_fs(old, **self.storage_options)[1], recursive=True)
        return self._record(len(data) * len(self.engines), t0, version)


register_transport("disk", DiskTransport)
