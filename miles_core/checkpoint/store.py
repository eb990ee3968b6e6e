"""Checkpoints under an fsspec root: a local path by default, or `s3://bucket/prefix`.

A checkpoint is a directory `<root>/<run>/step_<N>/` holding
- an ordinary HF model directory (config.json, model.safetensors, tokenizer files);
- `optimizer/`: the AdamW state written with torch.distributed.checkpoint (one shard per rank);
- `trainer_state.json`: the LR scheduler's state and the trainer's world size;
- `state.json`: the run state (`RLRuntime.save`): step, policy (= weight) version, sha256 of the
  engine's weights, the model the run started from, the data position, RNG states (trainer
  process torch / Python / numpy; an in-process engine's generator), the MLflow run id, the
  model architecture, the config, and the metrics of its step (re-logged on resume if the
  process died before it flushed them);
- `rollout_buffer.json` (async modes, `rollout/buffer_state.py`): the producer's groups
  completed but not yet trained and those in flight, so a resume trains each exactly once;
- `trained_samples.json` (`ledger.py`): the sample ids of each step since the previous
  checkpoint, and that checkpoint's step.
`<root>/<run>/latest` names the newest (written last: a checkpoint it names is complete).
Remote roots are staged in a local directory and uploaded; loading downloads first.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from miles_core.models.builder import architecture_of, check_same_architecture

STATE_FILE = "state.json"
BASE_MODEL_DIR = "base_model"  # a LoRA run's frozen base, saved once


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; nothing already saved was changed."""


class CheckpointStore:
    def __init__(self, root: str, run_name: str, storage_options: dict[str, Any] | None = None):
        self.root = root.rstrip("/")
        self.run_name = run_name
        self.fs, base = url_to_fs(self.root, **(storage_options or {}))
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.base = f"{base}/{run_name}"
        self._staging_dir: Path | None = None  # made on first use: a local root needs none

    @property
    def _staging(self) -> Path:
        """Local staging for uploads to and downloads from a remote root (`miles-ckpt-*`),
        removed by `close`."""
        if self._staging_dir is None:
            self._staging_dir = Path(tempfile.mkdtemp(prefix="miles-ckpt-"))
        return self._staging_dir

    def _url(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def uri(self, step: int) -> str:
        return self._url(f"{self.base}/step_{step:06d}")

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        state: dict[str, Any],
        json_files: dict[str, Any] | None = None,
    ) -> str:
        """`write(local_dir)` fills a directory; `state` (state.json) and `json_files` (name →
        data) are written beside; it is then published as step `step`. A save that fails (disk
        full, credentials, ...) raises CheckpointSaveError and leaves the earlier checkpoints
        and `latest` as they were (its partial files are removed)."""
        name = f"step_{step:06d}"
        target = f"{self.base}/{name}"
        local = Path(self.base) / f".{name}.tmp" if self.is_local else self._staging / name
        try:
            if self.is_local:
                Path(self.base).mkdir(parents=True, exist_ok=True)
            shutil.rmtree(local, ignore_errors=True)
            write(local)
            for file_name, data in (json_files or {}).items():
                _write_json(local / file_name, data)
            _write_json(local / STATE_FILE, state)
            if self.is_local:
                shutil.rmtree(target, ignore_errors=True)
                local.rename(target)
            else:
                if self.fs.exists(target):
                    self.fs.rm(target, recursive=True)
                self.fs.put(str(local), target, recursive=True)
            self.mark_latest(step)
        except Exception as e:
            shutil.rmtree(local, ignore_errors=True)
            previous = self.latest_step_or_none()
            kept = f"step {previous} is the latest" if previous is not None else "none saved yet"
            raise CheckpointSaveError(
                f"saving step {step} to {self._url(self.base)} failed ({e}); the earlier "
                f"checkpoints are untouched ({kept})"
            ) from e
        finally:
            if not self.is_local:
                shutil.rmtree(local, ignore_errors=True)
        return self._url(target)

    def save_base(self, model_dir: Path, marker: str = "config.json") -> str:
        """Copies the model directory `model_dir` beside the checkpoints (`base_model`: a LoRA
        run's frozen base, an image run's starting model; saved once) unless it is there (its
        `marker` file exists); returns its URI."""
        target = f"{self.base}/{BASE_MODEL_DIR}"
        if not self.fs.exists(f"{target}/{marker}"):
            if self.is_local:
                partial = Path(f"{target}.tmp")
                shutil.rmtree(partial, ignore_errors=True)
                shutil.copytree(model_dir, partial)
                partial.rename(target)
            else:
                self.fs.put(str(model_dir), target, recursive=True)
        return self._url(target)

    def latest_step_or_none(self) -> int | None:
        try:
            return self.latest_step()
        except Exception:  # noqa: BLE001  (only for a message: the store may be unreachable)
            return None

    def check_writable(self) -> None:
        """Writes and removes a probe file, so bad credentials or paths fail before training; a
        run folder it had to create is removed again (a refused run leaves none behind)."""
        probe = f"{self.base}/.write-probe"
        made = self.is_local and not Path(self.base).exists()
        try:
            self.fs.makedirs(self.base, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)
        except Exception as e:
            raise OSError(f"checkpoint root {self._url(self.base)} is not writable: {e}") from e
        finally:
            if made:
                with contextlib.suppress(OSError):
                    Path(self.base).rmdir()

    def latest_step(self) -> int | None:
        marker = f"{self.base}/latest"
        if not self.fs.exists(marker):
            return None
        return int(self.fs.cat_file(marker).decode().strip())

    def steps(self) -> list[int]:
        """The steps that have a published checkpoint, ascending."""
        if not self.fs.exists(self.base):
            return []
        found = []
        for path in self.fs.ls(self.base, detail=False):
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_") and name[5:].isdigit():
                found.append(int(name[5:]))
        return sorted(found)

    def mark_latest(self, step: int) -> None:
        """Points `latest` at `step`, atomically: a process killed mid-write, or a reader
        meanwhile, sees the old marker or the new one, never a partial file (local: write
        beside + rename; object stores replace an object whole)."""
        marker = f"{self.base}/latest"
        if not self.is_local:
            self.fs.pipe_file(marker, str(step).encode())
            return
        tmp = Path(f"{self.base}/.latest.tmp")
        tmp.write_text(str(step))
        tmp.replace(marker)

    def remove_all(self) -> None:
        """Deletes every checkpoint of this run (checkpoint.overwrite on a new run)."""
        if self.fs.exists(self.base):
            self.fs.rm(self.base, recursive=True)

    def fetch(self, step: int) -> Path:
        """A local directory with the checkpoint's files (downloaded for remote roots)."""
        target = f"{self.base}/step_{step:06d}"
        if not self.fs.exists(target):
            raise FileNotFoundError(f"no checkpoint at {self._url(target)}")
        if self.is_local:
            return Path(target)
        local = self._staging / f"fetched_step_{step:06d}"
        shutil.rmtree(local, ignore_errors=True)
        self.fs.get(target + "/", str(local), recursive=True)
        return local

    def read_state(self, step: int) -> dict[str, Any]:
        with self.fs.open(f"{self.base}/step_{step:06d}/{STATE_FILE}", "rt") as f:
            return json.load(f)

    def read_json(self, step: int, file_name: str) -> Any | None:
        """A JSON file of checkpoint `step` (None if the checkpoint has no such file)."""
        path = f"{self.base}/step_{step:06d}/{file_name}"
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rt") as f:
            return json.load(f)

    def close(self) -> None:
        if self._staging_dir is not None:
            shutil.rmtree(self._staging_dir, ignore_errors=True)
            self._staging_dir = None


def fetch_model_dir(
    url: str,
    storage_options: dict[str, Any] | None = None,
    into: Path | None = None,
    marker: str = "config.json",
) -> Path:
    """A local copy of a model directory (HF: `marker` config.json; an image model's:
    model_index.json) given as a local path (used in place) or fsspec URL (downloaded into a
    new `miles-model-*` folder, under `into` when given: a run passes its work folder, so the
    copy goes when the run's temp folders do)."""
    fs, path = url_to_fs(url, **(storage_options or {}))
    if not fs.exists(f"{path}/{marker}"):
        raise FileNotFoundError(f"{url} is not a model directory (no {marker})")
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    local = Path(tempfile.mkdtemp(prefix="miles-model-", dir=into))
    fs.get(path + "/", str(local), recursive=True)
    return local


@contextlib.contextmanager
def local_model_dir(url: str, storage_options: dict[str, Any] | None = None):
    """`fetch_model_dir` for a block: a downloaded copy is removed afterwards (a local
    directory is used in place and kept)."""
    remote = not isinstance(url_to_fs(url, **(storage_options or {}))[0], LocalFileSystem)
    local = fetch_model_dir(url, storage_options)
    try:
        yield local
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)


def check_checkpoint_matches(
    expected_architecture: dict, url: str, storage_options: dict | None = None
) -> None:
    """Refuses a checkpoint whose model config differs from the model being trained."""
    with fsspec.open(f"{url.rstrip('/')}/config.json", "rt", **(storage_options or {})) as f:
        found = architecture_of(json.load(f))
    check_same_architecture(expected_architecture, found, url)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
