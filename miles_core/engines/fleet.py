"""The engine fleet of a run: the rollout engine built by name (`rollout.engine`, through the
engine registry in `registry.py`), the engine server processes it may run in, and their
supervision (a dead or hung server is replaced on the same port and given the current weights
before it serves).

`surviving(what, call)` runs a call over HTTP (a push, a checksum); if it fails because an
engine server died, it waits for the replacement and makes the call once more. With
`rollout.engine_options.num_engines` > 1 the engine servers sit behind sglang-router
(`engines/routed.py`); each has its own supervisor, and a replacement rejoins the router
only once it holds the current weights. `gauges()`: per-engine active requests and prefix-cache
hit rate, logged with each step's rollout metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.engines.protocol import EngineUnavailable, RolloutEngine
from miles_core.engines.registry import ENGINES, EngineSetup
from miles_core.engines.supervisor import EngineSupervisor, RoutedSupervision, replaced_since
from miles_core.rollout.mode import MODES
from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.weights.remote import PushFailed
from miles_core.weights.transport import TRANSPORTS, TransportContext

log = logging.getLogger("miles")
GAUGE_TIMEOUT_S = 2.0  # a hung engine must not hold up the step that reads its gauges


class EngineFleet:
    """The run's engine (generation: one server's client, or a router's over several), its
    engine servers (none for an in-process engine), each with its own client (weight pushes and
    checks) and its supervisor (from `supervise`), and the router in front of several."""

    def __init__(self, config, model, tokenizer, model_dir: Path, workdir: Path, cluster=None):
        from miles_core.lora.adapter import engine_spec
        from miles_core.precision.plan import QuantPlan
        from miles_core.processes.auth import run_key

        # every server this run starts requires it, and only this run's clients send it
        self.api_key: str = run_key(config.network.api_key)
        ws = config.weight_sync
        transport = TRANSPORTS.get(ws.transport)
        # where the engine servers may load weights from disk: what the transport writes, if any
        roots = transport.engine_roots(
            TransportContext.of_run(config, workdir), ws.transport_options
        )
        r = config.rollout
        mode = MODES.get(r.mode)
        # a mode with a producer may have 1 + max_staleness steps of groups in flight at once
        in_flight = 1 + mode.staleness(r.mode_options).max_staleness if mode.ahead else 1
        setup = EngineSetup(
            config.rollout,
            model,
            tokenizer,
            model_dir,
            config.rollout.seed + config.seed,
            workdir,
            config.network.ports,
            self.api_key,
            roots,
            r.engine_options,
            r.prompts_per_step * r.n_samples_per_prompt * in_flight,
            mode.ahead,
            config.train.true_on_policy,
            QuantPlan.spec_of(config),
            engine_spec(config.train.lora, model),
        )
        if cluster is not None:  # the run's cluster places the engine servers (cluster/)
            setup.start_process = cluster.start_process
        built = ENGINES.get(r.engine).build(setup)
        self.config = config
        self.engine: RolloutEngine = built.engine
        self.servers: list[tuple[Any, RolloutEngine]] = list(built.servers)
        self.router: Any = built.router
        self.supervision = built.supervision
        self.supervisors: list[EngineSupervisor] = []
        self._seen: dict[str, tuple[float, float]] = {}  # per engine: prompt, cached tokens

    @property
    def process(self) -> Any:
        """The first engine server's process (None for an in-process engine)."""
        return self.servers[0][0] if self.servers else None

    @property
    def supervisor(self) -> EngineSupervisor | None:
        return self.supervisors[0] if self.supervisors else None

    @property
    def engines(self) -> list[RolloutEngine]:
        """What weights are pushed to: every engine server's own client (or the engine)."""
        return [client for _, client in self.servers] or [self.engine]

    @property
    def url(self) -> str:
        """Where generation requests go: the router, else the one engine server."""
        return self.router.url if self.router is not None else self.process.url

    def supervise(self, serve_weights: Callable[[RolloutEngine], None], reconnects: bool) -> None:
        """Heartbeats for each engine server (none for an in-process engine); a replacement gets
        the trainer's weights from `serve_weights(its client)` before it serves, out of the
        router's rotation until then. A transport that cannot reconnect (`reconnects` false)
        cannot serve a replacement: a dead engine fails the run."""
        if not self.servers or self.supervision is None:
            return
        sv = self.supervision
        restarts = sv.max_restarts
        if not reconnects and restarts:
            log.info(
                "weight_sync.transport %s cannot reconnect to a replaced engine server: a dead "
                "engine fails the run (replacement needs shared_memory or disk)",
                self.config.weight_sync.transport,
            )
            restarts = 0
        for process, client in self.servers:
            supervisor = EngineSupervisor(
                process,
                lambda c=client, p=process: self._serve(serve_weights, c, p),
                interval_s=sv.interval_s,
                timeout_s=sv.timeout_s,
                max_restarts=restarts,
                on_dead=None if self.router is None else self._leave_router,
            ).start()
            self.supervisors.append(supervisor)
        # generation calls that die with an engine wait for its replacement and are re-issued
        # once (behind a router, through the router: engines/supervisor.py RoutedSupervision)
        self.engine.supervisor = (
            self.supervisors[0] if self.router is None else RoutedSupervision(self.supervisors)
        )

    def _serve(self, serve_weights, client: RolloutEngine, process) -> None:
        serve_weights(client)
        if self.router is not None:  # back in rotation only with the current weights
            self.router.add_worker(process.url)

    def _leave_router(self, url: str) -> None:
        try:
            self.router.quarantine(url)
        except Exception as e:  # noqa: BLE001  (the router drops a dead engine itself too)
            log.warning("could not take %s out of the router: %r", url, e)

    def surviving(self, what: str, call: Callable, *args):
        """`call(*args)`; if it fails because an engine server died, waits for its
        replacement and makes the call once more."""
        if not self.supervisors:
            return call(*args)
        seen = [s.wait_serving() for s in self.supervisors]
        try:
            return call(*args)
        except (PushFailed, EngineUnavailable) as e:
            wait_for_replacements(self.supervisors, seen, e)
        log.warning("repeating the %s on the replaced engine server", what)
        return call(*args)

    def checksum(self) -> str:
        """sha256 of the weights the engines generate with (every engine answers it; several
        must agree)."""
        return self.surviving("weights checksum", self.engine.weights_checksum)

    @property
    def where(self) -> str:
        return getattr(self.engine, "url", "in this process")

    def gauges(self) -> dict[str, float]:
        """Per engine server i: `engine/<i>/active_requests` and `waiting_requests` now, and
        `engine/<i>/prefix_cache_hit_rate` over the prompt tokens since the last call; with
        several, `engine/prefix_cache_hit_rate` over all of them. {} for in-process engines
        and for engines that do not report them (SGLang's)."""
        out: dict[str, float] = {}
        prompt_all = cached_all = 0.0
        for i, (process, client) in enumerate(self.servers):
            try:
                info = client.server_info(timeout=GAUGE_TIMEOUT_S)
            except Exception:  # noqa: BLE001  (a dead, hung or replaced engine: no gauge now)
                continue
            if "prompt_tokens" not in info:
                continue
            prompt, cached = float(info["prompt_tokens"]), float(info["cached_tokens"])
            last_prompt, last_cached = self._seen.get(process.url, (0.0, 0.0))
            if prompt < last_prompt:  # a replaced engine counts from zero
                last_prompt = last_cached = 0.0
            self._seen[process.url] = (prompt, cached)
            d_prompt, d_cached = prompt - last_prompt, cached - last_cached
            prompt_all, cached_all = prompt_all + d_prompt, cached_all + d_cached
            out[f"engine/{i}/active_requests"] = float(info.get("running", 0.0))
            out[f"engine/{i}/waiting_requests"] = float(info.get("waiting", 0.0))
            if d_prompt:
                out[f"engine/{i}/prefix_cache_hit_rate"] = d_cached / d_prompt
        if len(self.servers) > 1 and prompt_all:
            out["engine/prefix_cache_hit_rate"] = cached_all / prompt_all
        return out

    def with_health(self, result: RolloutResult) -> RolloutResult:
        """The rollout's metrics plus the supervisors' (restarts, re-issued calls) and the
        engines' gauges."""
        result.metrics |= supervision_metrics(self.supervisors) | self.gauges()
        return result

    def stop_supervision(self) -> None:
        """First at shutdown: a stopped engine must not be replaced."""
        for supervisor in self.supervisors:
            supervisor.stop()

    def close(self) -> None:
        """The engine's clients, then the router, then the engine servers (each stopped even
        if an earlier step fails)."""
        try:
            self.engine.close()
            for _, client in self.servers:
                if client is not self.engine:
                    client.close()
        finally:
            try:
                if self.router is not None:
                    self.router.stop()
            finally:
                for process, _ in self.servers:
                    process.stop()


def supervision_metrics(supervisors: list[EngineSupervisor]) -> dict[str, float]:
    """The supervisors' counters, summed over the engines."""
    out: dict[str, float] = {}
    for supervisor in supervisors:
        for key, value in supervisor.metrics().items():
            out[key] = out.get(key, 0.0) + value
    return out


def wait_for_replacements(
    supervisors: list[EngineSupervisor], seen: list[int], error: BaseException
) -> None:
    """After a call made when supervisor i served generation `seen[i]` failed with `error`:
    returns once every engine replaced since serves (at least one was); re-raises `error` if
    none died within a health timeout (the failure was not an engine's death)."""
    deadline = time.monotonic() + max(s.timeout_s + 2 * s.interval_s for s in supervisors)
    while True:
        replaced = replaced_since(supervisors, seen)
        if replaced:
            return
        if replaced is False and time.monotonic() > deadline:
            raise error
        time.sleep(0.05)
