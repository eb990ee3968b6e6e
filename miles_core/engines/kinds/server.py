"""`server`: our serving engine as subprocesses on 127.0.0.1 behind SGLang's HTTP API (one, or
several behind sglang-router: `engines/routed.py`), supervised and replaced when they die, stopped
by PID when the run closes. Weights travel by shared memory, disk or a process group."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, model_validator

from miles_core.engines.kinds.serving import Serving, ServingOptions
from miles_core.engines.protocol import SERVER_ROUTES, RolloutEngine
from miles_core.engines.registry import (
    ENGINES,
    BuiltEngine,
    EngineSetup,
    Supervision,
)


class ServerOptions(ServingOptions):
    threads: int | None = Field(
        None, ge=1, description="torch threads of each engine server process (default: all cores)"
    )
    num_engines: int = Field(
        1,
        ge=1,
        le=64,
        description="engine server processes; more than one sit behind sglang-router, with a "
        "request's routing key (an agent session's id) sticking to one",
    )
    health_interval_s: float = Field(
        1.0,
        gt=0,
        description="seconds between heartbeats (/health, and whether the process still runs; "
        "an exited process is replaced at once)",
    )
    health_timeout_s: float = Field(
        6.0,
        gt=0,
        description="an engine without a healthy /health answer for this long (hung, e.g. "
        "SIGSTOP) is killed and replaced; must exceed health_interval_s",
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        description="most engine replacements (attempts) in a run; the next death fails the "
        "run (0: a dead engine fails the run at once)",
    )

    @model_validator(mode="after")
    def _health_bounds(self) -> ServerOptions:
        if self.health_timeout_s <= self.health_interval_s:
            raise ValueError(
                f"health_timeout_s ({self.health_timeout_s}) must exceed health_interval_s "
                f"({self.health_interval_s}): an engine is declared dead after several missed "
                "heartbeats"
            )
        return self


@ENGINES.register("server")
class Server(Serving):
    """The serving engine (its model check, the fields it fills) in processes of its own."""

    routes = SERVER_ROUTES
    Options = ServerOptions

    @classmethod
    def num_engines(cls, options: ServerOptions) -> int:
        return options.num_engines

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        from miles_core.engines.http import EngineProcess, HttpEngine

        s, r, o = setup, setup.rollout, setup.options
        args = ["--max-running", str(setup.max_in_flight), "--seed", str(s.seed)]
        args += ["--dtype", o.dtype, "--device", o.device]
        if o.threads:
            args += ["--threads", str(o.threads)]
        if s.true_on_policy:
            args += ["--true-on-policy"]
        if s.precision:
            args += ["--precision", json.dumps(s.precision)]
        if s.lora:
            args += ["--lora", json.dumps(s.lora)]
        supervision = Supervision(o.health_interval_s, o.health_timeout_s, o.max_engine_restarts)
        servers: list[tuple[Any, RolloutEngine]] = []
        processes: list[Any] = []
        router = None
        try:
            for i in range(o.num_engines):
                process = EngineProcess(
                    s.model_dir,
                    args=args,
                    log_path=s.workdir
                    / ("engine.log" if o.num_engines == 1 else f"engine-{i}.log"),
                    port_range=s.port_range,
                    api_key=s.api_key,  # in the child's environment, not its command line
                    weight_roots=s.weight_roots,  # the disk transport's root (miles_core/processes/roots.py)
                )
                # started here, or where the run's cluster puts it (maybe all at once)
                processes.append(s.start_process(process, i))
            for process in processes:
                # our engine server takes SGLang's batch form: one call per group
                client = HttpEngine(
                    process.url,
                    concurrency=s.batch,
                    batch_size=r.n_samples_per_prompt,
                    api_key=s.api_key,
                )
                servers.append((process, client))
            if o.num_engines == 1:
                return BuiltEngine(servers[0][1], servers, supervision=supervision)
            from miles_core.engines.routed import RoutedEngine
            from miles_core.engines.router import RouterProcess

            router = RouterProcess(
                [p.url for p, _ in servers],
                log_path=s.workdir / "router.log",
                port_range=s.port_range,
                api_key=s.api_key,
            ).start()
            routed = RoutedEngine(
                router.url, [c for _, c in servers], concurrency=s.batch, api_key=s.api_key
            )
            return BuiltEngine(routed, servers, router, supervision=supervision)
        except BaseException:
            for _, client in servers:
                client.close()
            for process in processes:
                process.stop()
            if router is not None:
                router.stop()
            raise
