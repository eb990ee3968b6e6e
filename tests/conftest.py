from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import miles_core  # noqa: F401  (applies env defaults: offline hub, no telemetry)
from tests import prefect_shared

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_HOME", str(REPO / ".prefect"))
# read once by torch's OpenMP runtime when it loads (nothing above imports torch): threads that
# finish a parallel region sleep instead of spinning. Two workers and their servers share few
# cores here, and spinning threads take the CPU from the processes doing the work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    # in the xdist controller before its workers start; every test that uses the Prefect
    # server is `slow`, so `-m "not slow"` (make test-fast) starts none
    slow_selected = "not slow" not in (config.getoption("markexpr") or "")
    prefect_shared.create_shared_dir(start_server=slow_selected)


def pytest_unconfigure(config):
    prefect_shared.stop()  # in the process that created the shared folder, after the workers


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API server for the whole test run, shared by the xdist workers
    (tests/prefect_shared.py; each costs ≈15 s to start); yields its API URL, which this
    worker's in-process flows use and `miles train` subprocesses get as `PREFECT_API_URL`."""
    import prefect.settings

    url = prefect_shared.api_url()
    with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: url}):
        yield url
        _drain_prefect_logs()


def _drain_prefect_logs() -> None:
    """This worker's buffered flow-run logs and events reach the server before the worker
    exits (as Prefect's test harness does before stopping its server)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.instance().drain()
    except RuntimeError:  # never started
        pass
    EventsWorker.drain_all()


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store with its schema created (≈1.5 s of migrations per new
    store): copied where a test's runs would otherwise create a store of their own."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_store(tmp_path, mlflow_template) -> str:
    """An empty, migrated `mlflow.db` in tmp_path (a copy of `mlflow_template`), where a test's
    runs track: `sqlite:///{tmp_path}/mlflow.db`, also the default `./mlflow.db` of a run
    started in tmp_path. Yields its URI."""
    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture(scope="session")
def moto_s3():
    """One S3-compatible server (moto) on 127.0.0.1 for the session; yields fsspec/s3fs
    storage options. Each module makes its own bucket."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    server.stop()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A seeded tiny Qwen3 model + tokenizer saved as an HF directory."""
    from miles_core.models import build_model, save_hf_dir

    model, tok = build_model("tiny", seed=0)
    return save_hf_dir(model, tok, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from miles_core.models import load_hf_dir

    return load_hf_dir(tiny_dir)


@pytest.fixture(scope="session")
def session_stack(tmp_path_factory):
    """An engine server (tiny model, 2048-token context: agent sessions are long) and a session
    server in front of it, both subprocesses stopped by PID: yields (engine, sessions). One pair
    for the whole session (test_sessions, test_agents, test_blackbox, test_openenv): each test
    opens its own sessions and none changes the servers' settings or weights."""
    from miles_core.engines.http import EngineProcess
    from miles_core.models import build_model, save_hf_dir
    from miles_core.sessions import SessionServerProcess

    logs = tmp_path_factory.mktemp("stack")
    model, tok = build_model("tiny", seed=0)
    model.config.max_position_embeddings = 2048
    model_dir = save_hf_dir(model, tok, logs / "model")
    args = ["--threads", "1", "--max-running", "16"]
    engine = EngineProcess(model_dir, args=args, log_path=logs / "engine.log")
    engine.start()
    sessions = SessionServerProcess(engine.url, "tiny", log_path=logs / "sessions.log")
    try:
        sessions.start()
        yield engine, sessions
    finally:
        sessions.stop()
        engine.stop()


# the longest modules (seconds of one worker, measured with --durations on 2 cores), longest
# first: a long module that starts last keeps one worker busy while the other idles
LONGEST_MODULES = (
    "test_kill_resume",
    "test_multirank",
    "test_ray",
    "test_flow",
    "test_agentic_run",
    "test_engine_recovery",
    "test_local_stack",
    "test_eval",
    "test_prefect_api",
    "test_fuzz",
    "test_router",
    "test_engine_server",
    "test_async",
    "test_processes",
    "test_true_on_policy",
    "test_auth",
    "test_agents",
    "test_moe",
    "test_transports",
    "test_tito",
    "test_storage",
    "test_orphans",
    "test_sessions",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (LONGEST_MODULES), then the other modules with slow tests, then
    the rest (stable within each group): under `-n 2 --dist loadfile --no-loadscope-reorder`
    (the Makefile's; xdist's default reorders the modules by test count) the long modules start
    early and the many short ones fill the end, so neither worker idles while the other
    finishes a long module."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    order = {id(item): i for i, item in enumerate(items)}

    def rank(it) -> tuple[int, int]:
        name = it.module.__name__.rsplit(".", 1)[-1]
        if name in LONGEST_MODULES:
            return LONGEST_MODULES.index(name), order[id(it)]
        return len(LONGEST_MODULES) + (it.module.__name__ not in slow_modules), order[id(it)]

    items.sort(key=rank)
