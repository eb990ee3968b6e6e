"""Rollout engines by name (`rollout.engine`): an `EngineKind` builds the engine a run uses from
its `EngineSetup` and declares the weight routes the engine takes, so a config's transport is
checked against its engine before anything starts. The built-ins are `engines/kinds/`, one module
each (`@ENGINES.register(name)`); another is an import path `package.module:Kind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.engines.protocol import IN_PROCESS_ROUTES, SERVER_ROUTES, RolloutEngine
from miles_core.plugins import NoOptions, PluginOptions, Registry


@dataclass
class EngineSetup:
    """What an engine factory may use: the rollout section and the run's model."""

    rollout: Any  # RolloutConfig
    model: Any  # the HF model, loaded from model_dir (in-process engines generate with it)
    tokenizer: Any
    model_dir: Path
    seed: int
    workdir: Path
    port_range: Any = None  # miles_core.processes.ports.PortRange | None
    api_key: str | None = None  # the run's key for the servers it starts (processes/auth.py)
    weight_roots: tuple[str, ...] = ()  # where an engine server may load weights from disk
    options: Any = None  # the engine's Options (rollout.engine_options)
    max_in_flight: int = 0  # most requests in flight at once (default: one rollout batch)
    beside_trainer: bool = False  # generates while the trainer trains (else they take turns)
    true_on_policy: bool = False  # generate with the invariant forward (train.true_on_policy)
    precision: dict | None = None  # quantized weights (rollout.precision: QuantPlan.spec_of)
    lora: dict | None = (
        None  # adapters served per request (train.lora: lora/adapter.py engine_spec)
    )
    # starts engine server `i`'s process (a ManagedProcess) where the run's cluster puts it,
    # healthy within `timeout` seconds
    start_process: Callable[..., Any] = field(
        default=lambda process, i, timeout=120.0: process.start(timeout=timeout)
    )

    @property
    def batch(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    def __post_init__(self) -> None:
        self.max_in_flight = self.max_in_flight or self.batch


@dataclass(frozen=True)
class Supervision:
    """How the run supervises an engine's servers: heartbeat interval, the silence after which
    one is replaced, and the most replacements."""

    interval_s: float
    timeout_s: float
    max_restarts: int


@dataclass
class BuiltEngine:
    """`engine` generates (over several servers: the router's client); `servers` are the engine
    server processes, each with its own client (weight pushes and checks go to each), to
    supervise and stop; `router` is the process in front of them (or None)."""

    engine: RolloutEngine
    servers: list[tuple[Any, RolloutEngine]] = field(default_factory=list)
    router: Any = None
    supervision: Supervision | None = None  # None: not supervised (in-process engines)

    @property
    def process(self) -> Any:
        """The first engine server's ManagedProcess (or None for an in-process engine)."""
        return self.servers[0][0] if self.servers else None


class EngineKind:
    """A rollout engine as a plug-in: `build(setup)` makes the run's engine; `routes`, the
    weight routes its engines take (the config checks the transport against them);
    `check_model(hf_config_dict)`, why it cannot run a model (or None); `answers`, the request
    flags of the token fields its engines fill (`TokenField.request_flag`); `quantized_weights`,
    whether its engines take `rollout.precision`'s quantized pushes (precision/served.py);
    `Options`, its settings (`rollout.engine_options`)."""

    routes: frozenset[str] = SERVER_ROUTES
    answers: frozenset[str] = frozenset()
    quantized_weights: bool = False
    Options: type[PluginOptions] = NoOptions

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        raise NotImplementedError

    @classmethod
    def check_model(cls, hf_config: dict[str, Any]) -> str | None:
        return None

    @classmethod
    def compute_dtype(cls, options: Any) -> str:
        """The dtype its engines compute in under these options (`rollout.engine_options`):
        with `train.true_on_policy`, the trainer's forward computes in it too."""
        return "float32"

    @classmethod
    def true_on_policy_refuses(cls, options: Any) -> str | None:
        """Why its engines cannot generate with the invariant forward of `train.true_on_policy`
        under these options (`rollout.engine_options`); None: they can."""
        return "it does not run the invariant forward"

    @classmethod
    def num_engines(cls, options: Any) -> int:
        """The engine servers it starts under these options (0: it runs in the trainer's
        process)."""
        return 0 if cls.in_trainer_process() else 1

    @classmethod
    def gpus_per_engine(cls, options: Any) -> int:
        """The GPUs each of its engines spans under these options (0: it runs on CPUs)."""
        return 0

    @classmethod
    def layout_problems(cls, options: Any, hf_config: dict[str, Any]) -> list[str]:
        """What of the model does not split over its engines' GPUs under these options (each
        naming the sizes; `miles plan`)."""
        return []

    @classmethod
    def gpu_share(cls, options: Any) -> float | None:
        """The share of each GPU's memory its engines take for weights and KV cache (None:
        the engine's own default)."""
        return None

    @classmethod
    def in_trainer_process(cls) -> bool:
        """Its engine runs in the trainer's process (weights handed over as tensors), as
        opposed to engine servers."""
        return cls.routes <= IN_PROCESS_ROUTES

    @classmethod
    def refuses(cls, hf_config: dict[str, Any], fields: Any = ()) -> str | None:
        """Why it cannot run a model of this HF config (a dict), or None; `fields`: the token
        fields the run asks its engines for."""
        for f in fields:
            if f.request_flag not in cls.answers:
                return f"it does not fill token field {f.name} ({f.request_flag})"
        return cls.check_model(hf_config)


def _engine_kind(obj: Any, name: str) -> type[EngineKind]:
    """An EngineKind subclass, or a factory `setup -> BuiltEngine` (routes: its `weight_routes`,
    else an engine server's) made into one."""
    if isinstance(obj, type) and issubclass(obj, EngineKind):
        return obj
    if not callable(obj):
        raise ValueError(f"rollout engine {name!r} is not an EngineKind or a factory: {obj!r}")
    return type(
        f"FactoryEngine_{name}",
        (EngineKind,),
        {
            "routes": frozenset(getattr(obj, "weight_routes", SERVER_ROUTES)),
            "answers": frozenset(getattr(obj, "answers", ())),
            "build": classmethod(lambda cls, setup: obj(setup)),
        },
    )


ENGINES: Registry[type[EngineKind]] = Registry(
    "rollout engine",
    "rollout.engine",
    package="miles_core.engines.kinds",
    example="package.module:EngineKind",
    load=_engine_kind,
)
