"""Rollout engines by name (`rollout.engine`), like transports and trainer backends: a factory
builds the engine a run uses from its `EngineSetup`, and declares the weight routes the engine
takes, so a config's transport is checked against its engine before anything starts.

    embedded  EmbeddedEngine in the trainer's process (tensor route)
    serving   ServingEngine in the trainer's process, stepped by the caller (tensor route)
    server    the serving engine as a subprocess behind SGLang's HTTP API (EngineProcess +
              HttpEngine: shared memory, disk, distributed group); supervised by the runtime

A new engine is a factory registered here (or under an import path `pkg.mod:factory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.engines.protocol import IN_PROCESS_ROUTES, SERVER_ROUTES, RolloutEngine
from miles_core.plugins import Registry


@dataclass
class EngineSetup:
    """What an engine factory may use: the rollout section and the run's model."""

    rollout: Any  # RolloutConfig
    model: Any  # the HF model, loaded from model_dir (in-process engines generate with it)
    tokenizer: Any
    model_dir: Path
    seed: int
    workdir: Path
    port_range: Any = None  # miles_core.proc.ports.PortRange | None
    api_key: str | None = None  # the run's key for the servers it starts (proc/auth.py)
    weight_roots: tuple[str, ...] = ()  # where an engine server may load weights from disk

    @property
    def batch(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt


@dataclass
class BuiltEngine:
    """`engine` generates (over several servers: the router's client); `servers` are the engine
    server processes, each with its own client (weight pushes and checks go to each), to
    supervise and stop; `router` is the process in front of them (or None)."""

    engine: RolloutEngine
    servers: list[tuple[Any, RolloutEngine]] = field(default_factory=list)
    router: Any = None

    @property
    def process(self) -> Any:
        """The first engine server's ManagedProcess (or None for an in-process engine)."""
        return self.servers[0][0] if self.servers else None


EngineFactory = Callable[[EngineSetup], BuiltEngine]


@dataclass(frozen=True)
class EngineKind:
    """A registered engine: its factory, the weight routes its engines take, and what it says of
    a model before anything starts (`check_model(hf_config_dict)`: why it cannot run it, or
    None)."""

    factory: EngineFactory
    routes: frozenset[str]
    check_model: Callable[[dict[str, Any]], str | None] | None = None
    routed_experts: bool = False  # answers return_routed_experts (MoE routing replay)


def _engine_kind(obj: Any, name: str) -> EngineKind:
    """An import path's factory as an engine kind (routes: its `weight_routes`, else the
    server's)."""
    if isinstance(obj, EngineKind):
        return obj
    if not callable(obj):
        raise ValueError(f"rollout engine {name!r} is not a factory: {obj!r}")
    routes = frozenset(getattr(obj, "weight_routes", SERVER_ROUTES))
    return EngineKind(
        obj,
        routes,
        getattr(obj, "check_model", None),
        bool(getattr(obj, "routed_experts", False)),
    )


ENGINES: Registry[EngineKind] = Registry("rollout engine", "rollout.engine", load=_engine_kind)


def register_engine(
    name: str,
    factory: EngineFactory,
    routes: frozenset[str],
    check_model: Callable[[dict[str, Any]], str | None] | None = None,
    routed_experts: bool = False,
) -> None:
    ENGINES.register(name, EngineKind(factory, frozenset(routes), check_model, routed_experts))


def engine_names() -> list[str]:
    return ENGINES.names()


def engine_routes(name: str) -> frozenset[str]:
    """The weight routes engine `name` takes (for config checks before anything starts)."""
    return ENGINES.get(name).routes


def engine_refuses(
    name: str, hf_config: dict[str, Any], routed_experts: bool = False
) -> str | None:
    """Why engine `name` cannot run a model of this HF config (a dict), or None;
    `routed_experts`: the run asks it for each token's routed experts."""
    kind = ENGINES.get(name)
    if routed_experts and not kind.routed_experts:
        return (
            "routed experts were asked for (routing replay), and this engine does not return "
            "them: use rollout.engine serving or server"
        )
    return None if kind.check_model is None else kind.check_model(hf_config)


def make_engine(name: str, setup: EngineSetup) -> BuiltEngine:
    return ENGINES.get(name).factory(setup)


# ---------------------------------------------------------------------- the built-in engines
def _embedded(s: EngineSetup) -> BuiltEngine:
    from miles_core.engines.cpu.embedded import EmbeddedEngine

    # a sync run's engine owns the process between training steps: it picks its threads
    sync = s.rollout.mode == "sync"
    return BuiltEngine(EmbeddedEngine(s.model, s.tokenizer, seed=s.seed, adapt_threads=sync))


def _serving(s: EngineSetup) -> BuiltEngine:
    from miles_core.engines.cpu.serving import ServingEngine

    r = s.rollout
    engine = ServingEngine(
        s.model,
        s.tokenizer,
        seed=s.seed,
        max_running=s.batch,
        dtype=r.dtype,
        scheduler="caller",
        device=r.device,
        adapt_threads=r.mode == "sync",  # in async modes a trainer computes beside it
    )
    return BuiltEngine(engine)


def _server(s: EngineSetup) -> BuiltEngine:
    """The serving engine as `rollout.num_engines` subprocesses on 127.0.0.1 (several: behind
    sglang-router, `engines/routed.py`), stopped by PID when the run closes."""
    from miles_core.engines.http import EngineProcess, HttpEngine

    r = s.rollout
    # async modes may have 1 + max_staleness steps of groups in flight at once
    running = s.batch if r.mode == "sync" else s.batch * (1 + r.max_staleness)
    args = ["--max-running", str(running), "--seed", str(s.seed), "--dtype", r.dtype]
    args += ["--device", r.device]
    if r.engine_threads:
        args += ["--threads", str(r.engine_threads)]
    servers: list[tuple[Any, RolloutEngine]] = []
    router = None
    try:
        for i in range(r.num_engines):
            process = EngineProcess(
                s.model_dir,
                args=args,
                log_path=s.workdir / ("engine.log" if r.num_engines == 1 else f"engine-{i}.log"),
                port_range=s.port_range,
                api_key=s.api_key,  # in the child's environment, not its command line
                weight_roots=s.weight_roots,  # the disk transport's root (miles_core/proc/roots.py)
            ).start()
            # our engine server takes SGLang's batch form: one call per group
            client = HttpEngine(
                process.url,
                concurrency=s.batch,
                batch_size=r.n_samples_per_prompt,
                api_key=s.api_key,
            )
            servers.append((process, client))
        if r.num_engines == 1:
            return BuiltEngine(servers[0][1], servers)
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
        return BuiltEngine(routed, servers, router)
    except BaseException:
        for process, client in servers:
            client.close()
            process.stop()
        if router is not None:
            router.stop()
        raise


def _runner_refuses(hf_config: dict[str, Any]) -> str | None:
    """The serving engine's forward (`engines/cpu/runner.py`) runs dense Qwen3 only."""
    from types import SimpleNamespace

    from miles_core.engines.cpu.runner import unsupported

    return unsupported(SimpleNamespace(**hf_config))


register_engine("embedded", _embedded, IN_PROCESS_ROUTES)
register_engine("serving", _serving, IN_PROCESS_ROUTES, _runner_refuses, routed_experts=True)
register_engine("server", _server, SERVER_ROUTES, _runner_refuses, routed_experts=True)
