"""MLflow tracking for one training run.

Everything goes through :class:`mlflow.tracking.MlflowClient` with an explicit ``run_id``; the
fluent API (``mlflow.log_metric`` & co.) keeps its active run in thread-local state and is not
used here, so a :class:`Tracker` can be driven from any thread or process.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient

log = logging.getLogger("miles")

# MLflow's per-request limits (mlflow.utils.validation).
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LENGTH = 6000

# Alias pointing at the newest policy version. MLflow reserves the alias "latest"
# (case-insensitive) because ``models:/<name>/latest`` already means "highest version number";
# set_registered_model_alias(..., "latest", ...) fails with INVALID_PARAMETER_VALUE.
NEWEST_POLICY_ALIAS = "newest"

DEFAULT_CURVE_KEYS = ("rollout/reward_mean",)


def _import_plotting() -> None:
    """matplotlib with the Agg backend (no display) and its figure and PNG writer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.backends.backend_agg  # noqa: F401  (savefig's PNG writer)
    import matplotlib.figure  # noqa: F401


EVAL_CURVE_KEY = "eval/reward_mean"  # plotted too when the run evaluates
# an agentic run's training success and its 9-step average (steplog.py: how the seeds' case
# study reports it), both reloaded on resume
SUCCESS_KEY, SUCCESS_MA_KEY = "rollout/success_rate", "rollout/success_rate_ma9"

_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")
_ALREADY_EXISTS = ErrorCode.Name(RESOURCE_ALREADY_EXISTS)

T = TypeVar("T")


def resolve_tracking_uri(explicit: str | None) -> str:
    """``explicit`` if given, else ``$MLFLOW_TRACKING_URI``, else a SQLite DB in the cwd."""
    if explicit:
        return explicit
    from_env = os.environ.get("MLFLOW_TRACKING_URI")
    if from_env:
        return from_env
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def check_tracking_uri(uri: str, setting: str = "tracking.tracking_uri") -> None:
    """Refuses (ValueError) a URI MLflow has no tracking store for (`bogus://x`), and a
    `sqlite:///` file whose folder does not exist; opens nothing (preflight)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    from mlflow.utils.uri import get_uri_scheme

    registry = _tracking_store_registry._registry
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception as e:  # noqa: BLE001  (MLflow's own refusal; ours names the setting)
        known = ", ".join(sorted(s for s in registry if s))
        raise ValueError(
            f"{setting} {uri!r}: MLflow has no tracking store for scheme "
            f"{get_uri_scheme(uri)!r} (known: {known}; or a local path)"
        ) from e
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise ValueError(f"{setting} {uri!r}: folder {folder} does not exist")


def _sqlite_path(tracking_uri: str) -> Path | None:
    return (
        Path(tracking_uri.removeprefix("sqlite:///"))
        if tracking_uri.startswith("sqlite:///")
        else None
    )


def _artifact_root(tracking_uri: str, experiment: str, configured: str | None = None) -> str | None:
    """Where a new experiment keeps its runs' artifacts: `configured` (a folder or a URI; each
    experiment in a sub-folder of its name), else, for a SQLite store, beside the DB file
    (`<db dir>/mlruns/<experiment>`), not in whatever directory the process runs in; else the
    store's default (None)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", experiment)
    if configured is not None:
        if "://" in configured:
            return f"{configured.rstrip('/')}/{safe}"
        return (Path(configured).expanduser() / safe).resolve().as_uri()
    db = _sqlite_path(tracking_uri)
    return None if db is None else (db.parent / "mlruns" / safe).resolve().as_uri()


def _create_sqlite_store(tracking_uri: str, configured: str | None) -> None:
    """A new SQLite store, created with the artifact root of its `Default` experiment beside it
    (or under `configured`): MLflow would give it `./mlruns` of the current directory."""
    db = _sqlite_path(tracking_uri)
    if db is None or db.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = _artifact_root(tracking_uri, "", configured)
    SqlAlchemyStore(tracking_uri, root.rstrip("/") if root else None)


REDACTED = "<redacted>"
# a param whose own name ends in a credential word: fsspec/boto storage options (key, secret,
# token, aws_secret_access_key, session_token), passwords, API keys
_SECRET_KEY = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?)$", re.I)


def flatten_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """Flatten a nested dict into MLflow params: dotted, sanitised keys and ``str`` values."""
    flat: dict[str, str] = {}
    for raw_key, value in tree.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, key))
            continue
        text = "{}" if isinstance(value, dict) else str(value)
        if value is not None and _SECRET_KEY.search(str(raw_key)):
            text = REDACTED  # credentials (storage_options, api keys) never reach MLflow
        flat[_BAD_KEY_CHARS.sub("_", key)] = text[:MAX_PARAM_VALUE_LENGTH]
    return flat


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _git_commit() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def _is_finite_number(value: Any) -> bool:
    return value is not None and math.isfinite(float(value))


class Tracker:
    """One MLflow run: params at start, buffered metrics, artifacts and policy versions."""

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str,
        params: dict | None = None,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        flush_interval_s: float = 0.0,
        artifact_location: str | None = None,
    ) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.artifact_location = artifact_location
        _create_sqlite_store(self.tracking_uri, artifact_location)
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.run_name = run_name
        self._buffer: list[Metric] = []
        # the async modes' train and evaluation loops log from two threads: a metric appended
        # to the old buffer after a flush took it would never be sent
        self._buffer_lock = threading.Lock()
        self.flush_interval_s = flush_interval_s  # flush_if_due: at most one write per interval
        self._last_flush = time.monotonic()
        # key -> step -> value; a step logged again (e.g. re-run after a resume) replaces the old point
        self._history: dict[str, dict[int, float]] = defaultdict(dict)
        self._artifact_dir: Path | None = None
        self._plotting: threading.Thread | None = None

        run_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        run_tags["mlflow.runName"] = run_name
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        commit = _git_commit()
        if commit:
            run_tags["mlflow.source.git.commit"] = commit

        if run_id is None:
            self.experiment_id = self._get_or_create_experiment(experiment)
            run = self.client.create_run(self.experiment_id, tags=run_tags, run_name=run_name)
            self.run_id = run.info.run_id
        else:
            run = self.client.get_run(run_id)
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
            self._reload_history(run.data.metrics)
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            self.set_tags(run_tags)

        # MLflow params are write-once: on re-attach (resume) only new keys are logged, and a
        # changed value is kept as a tag `miles.resume.<key>` instead of being refused.
        flat = flatten_params(params or {})
        existing = run.data.params if run_id is not None else {}
        changed = {
            f"miles.resume.{k}": v for k, v in flat.items() if k in existing and existing[k] != v
        }
        fresh = [Param(k, v) for k, v in flat.items() if k not in existing]
        for chunk in _chunks(fresh, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)
        if changed:
            self.set_tags(changed)

    def _get_or_create_experiment(self, name: str) -> str:
        wanted = _artifact_root(self.tracking_uri, name, self.artifact_location)
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            if wanted is not None and existing.artifact_location.rstrip("/") != wanted:
                log.info(
                    "experiment %r keeps its artifacts at %s, where it was created (not %s)",
                    name,
                    existing.artifact_location,
                    wanted,
                )
            return existing.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=wanted)
        except MlflowException as exc:  # created concurrently by another process
            if exc.error_code != _ALREADY_EXISTS:
                raise
            existing = self.client.get_experiment_by_name(name)
            assert existing is not None
            return existing.experiment_id

    # -- metrics ---------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer ``metrics`` at ``step`` (no MLflow call); None/NaN/inf values are dropped."""
        timestamp = int(time.time() * 1000)
        with self._buffer_lock:
            for key, value in metrics.items():
                if not _is_finite_number(value):
                    continue
                val = float(value)
                self._buffer.append(Metric(key, val, timestamp, int(step)))
                self._history[key][int(step)] = val

    def flush(self) -> None:
        """Send buffered metrics now, one ``log_batch`` per <=1000 of them."""
        with self._buffer_lock:
            buffered, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        for chunk in _chunks(buffered, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def flush_if_due(self) -> bool:
        """`flush` when `flush_interval_s` has passed since the last one (the step loop's call);
        returns whether it sent. The write stays on the caller's thread: a writer thread would
        hold the GIL for its SQL while the next rollout runs, and per-token Python loses ≈3×
        the write's time to that contention (measured at the tiny preset). Fast steps share one
        write per interval; steps longer than the interval each write at once."""
        if time.monotonic() - self._last_flush < self.flush_interval_s:
            return False
        self.flush()
        return True

    def _reload_history(self, latest: dict[str, float]) -> None:
        """On re-attach, the curve keys' past points come back, so the reward curve of a resumed
        run covers the whole run."""
        for key in latest:
            curves = (*DEFAULT_CURVE_KEYS, EVAL_CURVE_KEY, SUCCESS_KEY, SUCCESS_MA_KEY)
            if key in curves or key.endswith("exact_match"):
                points = self.client.get_metric_history(self.run_id, key)
                self._history[key] = {
                    m.step: m.value for m in sorted(points, key=lambda m: m.timestamp)
                }

    def history(self, key: str) -> list[tuple[int, float]]:
        return sorted(self._history.get(key, {}).items())

    # -- tags and artifacts ----------------------------------------------------------------

    def set_tags(self, tags: dict[str, str]) -> None:
        run_tags = [RunTag(str(k), str(v)) for k, v in tags.items()]
        for chunk in _chunks(run_tags, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=chunk)

    def log_dict_artifact(self, data: dict, filename: str) -> None:
        self.client.log_dict(self.run_id, data, filename)

    def prepare_curve(self) -> None:
        """Imports the plotting library in a daemon thread, once: called when the steps run, so
        the import overlaps them and the reward curve at the run's end does not wait for it."""
        if self._plotting is None:
            self._plotting = threading.Thread(target=_import_plotting, name="plotting", daemon=True)
            self._plotting.start()

    def log_reward_curve(
        self,
        keys: list[str] | None = None,
        filename: str = "reward_curve.png",
        also_to: Path | None = None,
    ) -> Path:
        """Plot metric histories against step, log the PNG as a run artifact, return its path
        (a local copy that lasts until `finish`).

        ``keys`` defaults to ``rollout/reward_mean``, ``eval/reward_mean`` and
        ``rollout/success_rate_ma9`` (when logged) and every ``*exact_match`` history key.
        ``also_to`` is a directory (the PNG is copied in as ``filename``) or a ``.png`` path.
        """
        _import_plotting()
        from matplotlib.figure import Figure  # no pyplot: no global figure state

        if keys is None:
            keys = [*DEFAULT_CURVE_KEYS]
            if EVAL_CURVE_KEY in self._history:
                keys.append(EVAL_CURVE_KEY)
            if SUCCESS_MA_KEY in self._history:
                keys.append(SUCCESS_MA_KEY)
            keys += sorted(k for k in self._history if k.endswith("exact_match") and k not in keys)

        fig = Figure(figsize=(8, 5))
        ax = fig.subplots()
        for key in keys:
            points = self.history(key)
            if points:
                steps, values = zip(*sorted(points), strict=True)
                ax.plot(steps, values, marker="o", markersize=3, label=key)
        ax.set_title(self.run_name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()

        if self._artifact_dir is None:
            self._artifact_dir = Path(tempfile.mkdtemp(prefix="miles-mlflow-"))
        path = self._artifact_dir / filename
        fig.savefig(path, format="png", dpi=100)
        self.client.log_artifact(self.run_id, str(path))

        if also_to is not None:
            dest = Path(also_to)
            dest = dest if dest.suffix == ".png" else dest / filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
        return path

    # -- model registry --------------------------------------------------------------------

    def log_policy_version(
        self,
        model_name: str,
        step: int,
        policy_version: int,
        source_uri: str,
        tags: dict[str, str] | None = None,
    ) -> str:
        """Register a saved checkpoint as a model version of ``model_name``; return the version.

        The version is tagged with ``step`` and ``policy_version`` and gets the alias
        :data:`NEWEST_POLICY_ALIAS`; the run gets tag ``miles.policy_version``.

        ``source_uri`` is passed through unchanged: a plain local absolute path and an
        ``s3://`` URI are both accepted by the SQL (sqlite) registry store, which does not
        validate sources. Note that an MLflow *tracking server* (http:// URI) rejects local
        sources, plain or ``file://``, unless they lie inside the run's artifact directory, so
        against a server checkpoints should live in object storage.
        """
        try:
            self.client.create_registered_model(model_name)
        except MlflowException as exc:
            if exc.error_code != _ALREADY_EXISTS:
                raise
        version_tags = {"step": str(step), "policy_version": str(policy_version)}
        version_tags.update({str(k): str(v) for k, v in (tags or {}).items()})
        model_version = self.client.create_model_version(
            name=model_name, source=source_uri, run_id=self.run_id, tags=version_tags
        )
        version = str(model_version.version)
        self.client.set_registered_model_alias(model_name, NEWEST_POLICY_ALIAS, version)
        self.set_tags({"miles.policy_version": str(policy_version)})
        return version

    def finish(self, status: str = "FINISHED") -> None:
        """Ends the MLflow run; the local copies of logged plots (`miles-mlflow-*`) go with it,
        also when the final calls to MLflow fail."""
        try:
            self.flush()
            self.client.set_terminated(self.run_id, status)
        finally:
            if self._artifact_dir is not None:
                shutil.rmtree(self._artifact_dir, ignore_errors=True)
                self._artifact_dir = None
