"""Disk transport: each push is a safetensors checkpoint under an fsspec root (a local path, or
s3://… for engines on other hosts), which the engines load with `/update_weights_from_disk`.

Layout: `<root>/weight_v{version:06d}/model.safetensors` + `manifest.json` ({"version", "kind":
full | delta, "tensors": {name: sha256 of the final raw bytes}, "files": {name: bytes}}). With `delta`, every push after
the first holds only the tensors that changed, encoded against the previous push (weights/delta.py;
the manifest names `base_version` and each encoded tensor's encoding, dtype and shape).
The engine verifies every tensor against the manifest before loading, so a corrupt, mismatched
or out-of-order file is refused and the engine keeps its weights. The only pause is the engine's
own load (between two scheduler steps); the write overlaps generation. Older versions are
removed, keeping `keep` of them.

An engine server reads only under its `--weight-roots` (miles_core/processes/roots.py, `confine`), and
answers a path outside them as a missing one inside (`not_found_message`); only regular files,
each no further than the manifest's size and the most bytes its model can hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import zlib
from pathlib import Path

import fsspec
import torch
from pydantic import Field
from safetensors.torch import load, save

from miles_core.engines.protocol import (
    DISK,
    LORA_UPSERT,
    EngineRequestRejected,
    ProcessUnavailable,
)
from miles_core.lora.adapter import ADAPTERS_DIR, Adapter, pairs_of
from miles_core.lora.names import is_wire_name, peft_key, split_wire_name
from miles_core.lora.versions import push_versions
from miles_core.plugins import PluginOptions
from miles_core.processes.roots import AllowedRoots, OutsideRoots
from miles_core.weights import delta
from miles_core.weights.remote import PushFailed, check_reachable
from miles_core.weights.source import TrainerWeights
from miles_core.weights.transport import (
    TRANSPORTS,
    PushStats,
    TransportBase,
    TransportContext,
)

MANIFEST = "manifest.json"


def tensor_sha256(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def version_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/weight_v{version:06d}"


class DiskOptions(PluginOptions):
    root: str | None = Field(
        None,
        description="fsspec root of the pushed weights (default: pushed_weights in the run's "
        "working directory); the engine servers may read nothing else",
    )
    keep_versions: int = Field(2, ge=1, description="pushed versions kept")
    delta: bool = Field(
        False,
        description="after the first push, write only changed tensors, encoded against the "
        "previous push (small with weight_sync.dtype: bfloat16)",
    )


def push_root(options: DiskOptions, workdir) -> str:
    """A run's disk-transport root: `root`, else `pushed_weights` in its workdir (where the
    transport writes, and the one root its engine servers read). A local root is made absolute:
    engines read only absolute paths under their roots."""
    root = options.root or str(Path(workdir) / "pushed_weights")
    return root if "://" in root else os.path.abspath(root)


def not_found_message(path: str) -> str:
    """The one answer for a path outside the roots and for a missing or unreadable one inside."""
    return f"no safetensors weights at {path!r} under this engine's weight roots"


def confine(roots: AllowedRoots, path: str) -> str:
    """The path an engine reads for a disk load of `path` (miles_core/processes/roots.py), or a
    RootRefusal: no roots configured, 403; malformed, 400; outside the roots, 403 with
    `not_found_message`, the answer of a missing path."""
    if not roots:
        raise OutsideRoots(
            "this engine loads no weights from disk: it was started without --weight-roots"
        )
    try:
        return roots.check(path, "model_path")
    except OutsideRoots:
        raise OutsideRoots(not_found_message(path)) from None


def load_weight_dir(
    path: str,
    storage_options: dict | None = None,
    current: dict[str, torch.Tensor] | None = None,
    current_version: int | None = None,
    roots: AllowedRoots | None = None,
    max_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Reads every *.safetensors file of a directory (local or fsspec URL), or one file. With a
    manifest, each tensor's sha256 must match it and the names must be exactly its names. A
    delta is decoded against `current` (the engine's weights), which must be at its base
    version; it returns only the changed tensors.

    An engine server passes `roots` (the path must lie under one: `confine`) and
    `max_bytes` (no file, and not all files together, may hold more). Only regular files are
    read, each no further than its size (the manifest's, when it names one); a missing,
    unreadable or non-regular path is "no safetensors weights" (WeightsNotFound), a file that is
    not safetensors or a store that cannot be reached is a WeightLoadError."""
    where = confine(roots, path) if roots is not None else path
    try:
        return _load(path, where, storage_options, current, current_version, roots, max_bytes)
    except _Gone:  # missing or unreadable midway: the answer of a missing path
        raise WeightsNotFound(path, roots is not None) from None


def _load(path, where, storage_options, current, current_version, roots, max_bytes):
    reader = _reader(where, storage_options, roots)
    listing = reader.listing(where)
    if listing is None:
        raise WeightsNotFound(path, roots is not None)
    base, is_dir, files = listing
    manifest = None
    if is_dir:
        raw = reader.read(f"{base}/{MANIFEST}", MANIFEST_MAX_BYTES, missing_ok=True)
        if raw is not None:
            try:
                manifest = json.loads(raw)
                if not isinstance(manifest, dict) or not isinstance(manifest["tensors"], dict):
                    raise ValueError("no tensors")
            except (ValueError, KeyError, UnicodeDecodeError) as e:
                raise WeightLoadError(f"{path}: {MANIFEST} is not a weights manifest ({e})") from e
    if not files:
        raise WeightsNotFound(path, roots is not None)
    sizes = _expected_sizes(path, manifest, files)
    limit = max_bytes
    total = 0
    tensors: dict[str, torch.Tensor] = {}
    for f, size in files:
        if size is None:  # a store that does not say (some HTTP servers): read to the limit
            data = reader.read(f, limit if limit is not None else 1 << 62)
            size = len(data)
        else:
            data = None
        if sizes is not None and size != sizes[_basename(f)]:
            raise WeightLoadError(
                f"{path}: {_basename(f)} holds {size} bytes, the manifest says "
                f"{sizes[_basename(f)]}; the file is corrupt or still being written"
            )
        total += size
        if limit is not None and (size > limit or total > limit):
            raise WeightLoadError(
                f"{path}: {_basename(f)} would read {total} bytes, more than this engine's "
                f"model can hold ({limit} bytes)"
            )
        if data is None:
            data = reader.read(f, size)
        try:
            tensors.update(load(data))
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise WeightLoadError(f"{path}: {_basename(f)} is not a safetensors file ({e})") from e
    if manifest is not None:
        expected = manifest["tensors"]
        if manifest.get("kind") == "delta":
            try:
                tensors = _apply_delta(path, manifest, tensors, current, current_version)
            except (KeyError, TypeError, AttributeError) as e:
                raise WeightLoadError(f"{path}: malformed delta manifest ({e!r})") from e
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


MANIFEST_MAX_BYTES = 64 << 20


class WeightLoadError(ValueError):
    """The weights at a path cannot be loaded (not safetensors, oversized, unreachable store)."""


class WeightsNotFound(WeightLoadError, FileNotFoundError):
    """Nothing loadable at a path. Missing, unreadable and non-regular paths answer the same."""

    def __init__(self, path: str, confined: bool = False):
        super().__init__(
            not_found_message(path) if confined else f"no safetensors weights at {path!r}"
        )


def _basename(f: str) -> str:
    return f.rstrip("/").rsplit("/", 1)[-1]


def _expected_sizes(path: str, manifest: dict | None, files: list) -> dict[str, int] | None:
    """The manifest's file sizes ({name: bytes}, written by DiskTransport), checked against the
    files present; None for a manifest without sizes (older pushes) or no manifest."""
    declared = (manifest or {}).get("files")
    if declared is None:
        return None
    try:
        sizes = {str(n): int(b) for n, b in declared.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise WeightLoadError(f"{path}: malformed file sizes in {MANIFEST} ({e})") from e
    present = {_basename(f) for f, _ in files}
    if present != set(sizes):
        raise WeightLoadError(
            f"{path}: files {sorted(present)} do not match the manifest's {sorted(sizes)}"
        )
    return sizes


def _reader(path: str, storage_options: dict | None, roots: AllowedRoots | None):
    if "://" not in path or path.startswith("file://"):
        return _LocalReader(roots)
    try:
        fs, base = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except (ImportError, ValueError) as e:  # an fsspec protocol this host lacks
        raise WeightLoadError(f"cannot read {path!r}: {e}") from e
    return _FsspecReader(fs, path, base)


class _Gone(Exception):
    """A file vanished or cannot be read: answered as a missing path."""


class _LocalReader:
    """Local files by their real path: regular files only, opened without following a final
    symlink and without blocking (a FIFO is refused, not waited on), read to their size."""

    def __init__(self, roots: AllowedRoots | None):
        self.roots = roots

    def listing(self, path: str):
        local = os.path.realpath(path.removeprefix("file://"))
        try:
            st = os.stat(local)
            if stat.S_ISREG(st.st_mode):
                return local, False, [(local, st.st_size)]
            if not stat.S_ISDIR(st.st_mode):
                return None
            files = []
            with os.scandir(local) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    if not entry.name.endswith(".safetensors"):
                        continue
                    real = os.path.realpath(entry.path)
                    if self.roots is not None and not self.roots.contains_local(real):
                        continue  # a link out of the roots: as if absent
                    try:
                        est = os.stat(real)
                    except OSError:
                        continue
                    if stat.S_ISREG(est.st_mode):
                        files.append((real, est.st_size))
            return local, True, files
        except OSError:  # missing, unreadable: the same answer
            return None

    def read(self, path: str, limit: int, missing_ok: bool = False) -> bytes | None:
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if missing_ok and isinstance(e, FileNotFoundError):
                return None
            raise _Gone(path) from None  # missing, unreadable, a link swapped in: as absent
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Gone(path)
            if st.st_size > limit:
                raise WeightLoadError(
                    f"{_basename(path)} holds {st.st_size} bytes, more than {limit} allowed"
                )
            chunks, left = [], limit + 1
            while left > 0:
                chunk = os.read(fd, min(left, 16 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
        except OSError:
            raise _Gone(path) from None
        finally:
            os.close(fd)
        if len(data) > limit:
            raise WeightLoadError(f"{_basename(path)} grew past {limit} bytes while being read")
        return data


def _size(info: dict) -> int | None:
    size = info.get("size")
    return None if size is None else int(size)


class _FsspecReader:
    """Files of an fsspec store (s3://, gs://, http://): sizes from the store's listing, reads
    bounded by them; a store that cannot be reached is a WeightLoadError."""

    def __init__(self, fs, url: str, base: str):
        self.fs = fs
        self.url = url
        self.base = base

    def _unreachable(self, e: Exception) -> WeightLoadError:
        return WeightLoadError(f"cannot read weights at {self.url!r}: {type(e).__name__}: {e}")

    def listing(self, path: str):
        base = self.base
        try:
            info = self.fs.info(base)
            if info.get("type") == "directory":
                entries = self.fs.ls(base, detail=True)
                files = sorted(
                    (e["name"], _size(e))
                    for e in entries
                    if e.get("type") == "file" and str(e["name"]).endswith(".safetensors")
                )
                return base, True, files
            if info.get("type") == "file":
                return base, False, [(base, _size(info))]
            return None
        except FileNotFoundError as e:
            cause = e.__cause__  # fsspec's HTTP store says "not found" for a refused connection
            if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
                raise self._unreachable(cause) from e
            return None
        except Exception as e:  # noqa: BLE001  (connection errors differ per store)
            raise self._unreachable(e) from e

    def read(self, path: str, limit: int, missing_ok: bool = False) -> bytes | None:
        try:
            with self.fs.open(path, "rb") as fh:
                data = fh.read(limit + 1)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise _Gone(path) from None
        except Exception as e:  # noqa: BLE001
            raise self._unreachable(e) from e
        if len(data) > limit:
            raise WeightLoadError(f"{_basename(path)} holds more than {limit} bytes")
        return data


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


@TRANSPORTS.register("disk")
class DiskTransport(TransportBase):
    route = DISK
    name = "disk"
    adapter_versions = True
    Options = DiskOptions

    @classmethod
    def build(cls, context: TransportContext, options: DiskOptions) -> DiskTransport:
        return cls(
            root=push_root(options, context.workdir),
            storage_options=context.storage_options,
            keep=options.keep_versions,
            delta=options.delta,
            bucket_bytes=context.bucket_bytes,
            dtype=context.dtype,
        )

    @classmethod
    def engine_roots(cls, context: TransportContext, options: DiskOptions) -> tuple[str, ...]:
        return (push_root(options, context.workdir),)

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
        configs = getattr(source, "adapter_configs", None)
        if tensors and all(map(is_wire_name, tensors)):
            if configs is not None:
                return self._push_adapters(tensors, configs(), path, version, t0)
            self._refuse_in_place_on(path)
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
                if not torch.equal(
                    t.reshape(-1).view(torch.uint8), self._base[n].reshape(-1).view(torch.uint8)
                )
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
        manifest["files"] = {"model.safetensors": len(data)}  # engines read no further
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
        self._keep_newest(path)
        return self._record(len(data) * len(self.engines), t0, version)

    def _keep_newest(self, path: str) -> None:
        if path not in self._written:  # a replaced engine gets the current version again
            self._written.append(path)
        while len(self._written) > self.keep:
            old = self._written.pop(0)
            fs, base = fsspec.core.url_to_fs(old, **self.storage_options)
            fs.rm(base, recursive=True)

    def _refuse_in_place_on(self, path: str) -> None:
        """Adapter tensors in the transport's own format replace adapters in place: refused, before
        anything is written, for an engine that cannot (it loads peft directories by version)."""
        for e in self.engines:
            if LORA_UPSERT not in e.weight_routes:
                raise PushFailed(
                    f"engine at {e.url} cannot replace adapters in place, and the push of {path} "
                    "carries adapter tensors without their peft configs (a snapshot): it needs "
                    "a source that knows them (the trainer's adapter_configs)"
                )

    def _push_adapters(self, tensors, configs: dict, path: str, version: int, t0) -> PushStats:
        """A LoRA push: each adapter as a peft directory (`<version dir>/adapters/<name>`:
        adapter_config.json + adapter_model.safetensors, what peft and SGLang's
        `/load_lora_adapter` load), loaded by the engines in place of the version before; an
        engine that cannot replace one in place loads it as a new version (lora/versions.py)."""
        by_adapter: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            adapter, module, part = split_wire_name(name)
            by_adapter.setdefault(adapter, {})[peft_key(module, part)] = t
        written, nbytes = {}, 0
        for name, peft_tensors in by_adapter.items():
            written[name] = f"{path}/{ADAPTERS_DIR}/{name}"
            adapter = Adapter(name, configs[name], pairs_of(peft_tensors))
            nbytes += adapter.save(written[name], self.storage_options)
        check_reachable(self.engines)
        for e in self.engines:
            try:
                if LORA_UPSERT in e.weight_routes:
                    for name, directory in written.items():
                        e.load_lora_adapter(name, directory, upsert=True)
                else:
                    push_versions(e, written, version)
                e.set_weight_version(version)
            except (ProcessUnavailable, EngineRequestRejected) as err:
                raise PushFailed(
                    f"engine at {e.url} did not load adapters at {path}: {err}"
                ) from err
        self._keep_newest(path)
        return self._record(nbytes * len(self.engines), t0, version)
