"""The engine fleet of a run: the rollout engine built by name (`rollout.engine`, through the
engine registry in `engines.py`), the engine server process it may run in, and that process's
supervision (a dead or hung server is replaced on the same port and given the current weights
before it serves).

`surviving(what, call)` runs a call over HTTP (a push, a checksum); if it fails because the
engine server died, it waits for the replacement and makes the call once more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.engine_api import EngineUnavailable, RolloutEngine
from miles_core.engines import EngineSetup, make_engine
from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.rollout.supervisor import EngineSupervisor
from miles_core.weights.disk import engine_weight_roots
from miles_core.weights.remote import PushFailed

log = logging.getLogger("miles")


class EngineFleet:
    """The run's engine (one today; a router over several later), its server process (or None
    for an in-process engine) and the process's supervisor (None until `supervise`)."""

    def __init__(self, config, model, tokenizer, model_dir: Path, workdir: Path):
        from miles_core.proc.auth import run_key

        # every server this run starts requires it, and only this run's clients send it
        self.api_key: str = run_key(config.network.api_key)
        setup = EngineSetup(
            config.rollout,
            model,
            tokenizer,
            model_dir,
            config.rollout.seed + config.seed,
            workdir,
            config.network.ports,
            self.api_key,
            engine_weight_roots(config.weight_sync, workdir),  # disk pushes: their root only
        )
        built = make_engine(config.rollout.engine, setup)
        self.config = config
        self.engine: RolloutEngine = built.engine
        self.process: Any = built.process  # an engine server's ManagedProcess, or None
        self.supervisor: EngineSupervisor | None = None

    def supervise(self, serve_weights: Callable[[], None], reconnects: bool) -> None:
        """Heartbeats for the engine server (no-op for an in-process engine); a replacement gets
        the trainer's weights from `serve_weights` before it serves. A transport that cannot
        reconnect (`reconnects` false) cannot serve a replacement: a dead engine fails the run."""
        if self.process is None:
            return
        r = self.config.rollout
        restarts = r.max_engine_restarts
        if not reconnects and restarts:
            log.info(
                "weight_sync.transport %s cannot reconnect to a replaced engine server: a dead "
                "engine fails the run (replacement needs shared_memory or disk)",
                self.config.weight_sync.transport,
            )
            restarts = 0
        self.supervisor = EngineSupervisor(
            self.process,
            serve_weights,
            interval_s=r.health_interval_s,
            timeout_s=r.health_timeout_s,
            max_restarts=restarts,
        ).start()
        self.engine.supervisor = self.supervisor  # its requests wait for a replacement

    def surviving(self, what: str, call: Callable, *args):
        """`call(*args)`; if it fails because the engine server died, waits for the
        replacement and makes the call once more."""
        if self.supervisor is None:
            return call(*args)
        seen = self.supervisor.wait_serving()
        try:
            return call(*args)
        except (PushFailed, EngineUnavailable) as e:
            self.supervisor.wait_for_replacement(seen, e)
        log.warning("repeating the %s on the replaced engine server", what)
        return call(*args)

    def checksum(self) -> str:
        """sha256 of the weights the engine generates with (every engine answers it)."""
        return self.surviving("weights checksum", self.engine.weights_checksum)

    @property
    def where(self) -> str:
        return getattr(self.engine, "url", "in this process")

    def with_health(self, result: RolloutResult) -> RolloutResult:
        """The rollout's metrics plus the supervisor's (restarts, re-issued calls)."""
        if self.supervisor is not None:
            result.metrics |= self.supervisor.metrics()
        return result

    def stop_supervision(self) -> None:
        """First at shutdown: a stopped engine must not be replaced."""
        if self.supervisor is not None:
            self.supervisor.stop()

    def close(self) -> None:
        """The engine's client, then its server process (stopped even if the client fails)."""
        try:
            self.engine.close()
        finally:
            if self.process is not None:
                self.process.stop()
