"""RLRuntime as a composition: a start-up that fails part-way stops what it had started, the
run's work folder included, whichever component fails (engine, trainer)."""

from __future__ import annotations

from pathlib import Path

import pytest

import miles_core.run.runtime as runtime
from miles_core.config import load_config
from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.registry import BuiltEngine, EngineSetup

CLOSED: list[str] = []


def recording_engine(setup: EngineSetup) -> BuiltEngine:
    """The embedded engine, recording its close (a test engine registered by import path)."""
    from miles_core.engines.cpu.embedded import EmbeddedEngine

    engine = EmbeddedEngine(setup.model, setup.tokenizer, seed=setup.seed)
    engine.close = lambda: CLOSED.append("engine")
    return BuiltEngine(engine)


recording_engine.weight_routes = IN_PROCESS_ROUTES


def failing_engine(setup: EngineSetup) -> BuiltEngine:
    raise RuntimeError("engine refused to start")


failing_engine.weight_routes = IN_PROCESS_ROUTES


class FailingBackend:
    def __init__(self, **_):
        raise RuntimeError("trainer refused to start")


def _start(tmp_path: Path, monkeypatch, *overrides: str):
    workdir = tmp_path / "miles-run-test"
    monkeypatch.setattr(runtime, "new_workdir", lambda: workdir.mkdir() or workdir)
    cfg = load_config(
        None,
        [
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            f"checkpoint.root={tmp_path / 'ckpt'}",
            *overrides,
        ],
    )
    model_dir = runtime.prepare_model_dir(cfg, tmp_path / "init")
    return workdir, lambda: runtime.RLRuntime(cfg, model_dir, None)


@pytest.mark.parametrize(
    "overrides, error, closed",
    [
        (["rollout.engine=test_runtime:failing_engine"], "engine refused to start", []),
        (
            [
                "rollout.engine=test_runtime:recording_engine",
                "train.backend=test_runtime:FailingBackend",
            ],
            "trainer refused to start",
            ["engine"],
        ),
    ],
)
def test_a_failed_start_up_stops_what_it_started(tmp_path, monkeypatch, overrides, error, closed):
    CLOSED.clear()
    workdir, start = _start(tmp_path, monkeypatch, *overrides)
    with pytest.raises(RuntimeError, match=error):
        start()
    assert CLOSED == closed  # the engine built before the failing trainer was closed
    assert not workdir.exists()  # the run's work folder went with it


def test_close_stops_every_component_once(tmp_path, monkeypatch):
    CLOSED.clear()
    workdir, start = _start(tmp_path, monkeypatch, "rollout.engine=test_runtime:recording_engine")
    rt = start()
    assert workdir.is_dir() and rt.engine_process is None and rt.supervisor is None
    rt.close()
    rt.close()  # a second close has nothing left to stop
    assert CLOSED == ["engine"]
    assert not workdir.exists()
