"""What both sides of the weight line share: the rollout-engine protocol, the weight-loading
routes an engine declares, and the two failures every engine client raises.

Import-light on purpose (no torch, no httpx, nothing from `rollout/` or `weights/`): the
engines (`rollout/`) implement this protocol and the transports (`weights/`) consume it, and
neither imports the other's internals.

Weight routes (SGLang's update APIs; an engine lists those it takes in `weight_routes`):

- `tensor`: named tensors handed over in the trainer's process (`update_weights_from_tensor`);
- `shared_memory`: bucket files in /dev/shm on the engine's host (`/update_weights_from_tensor`
  with `load_format: shared_memory`);
- `disk`: a safetensors directory (`/update_weights_from_disk`);
- `distributed`: a process group with the trainer (`/init_weights_update_group` +
  `/update_weights_from_distributed`: broadcast buckets, or p2p shards).

A transport names the route it needs (`WeightTransport.route`); `connect` refuses an engine that
does not list it (`require_route`).

LoRA adapters travel over every route. What differs between engines is whether one can replace a
loaded adapter in place under its name (`lora_upsert`: ours, in process and over HTTP); one that
cannot (SGLang) takes each push as a new adapter version (miles_core/lora/versions.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from miles_core.engines.wire import GenerateRequest, GenerateResponse

TENSOR = "tensor"
SHARED_MEMORY = "shared_memory"
DISK = "disk"
DISTRIBUTED = "distributed"
WEIGHT_ROUTES = frozenset({TENSOR, SHARED_MEMORY, DISK, DISTRIBUTED})

# not a route but a way of taking one: the weight call itself carries `pause_mode` and the engine
# pauses (mode), loads, sets the version and continues within it (one HTTP call per push instead
# of pause, load, continue); our engine server declares it, SGLang does not
PAUSED_PUSH = "paused_push"
# not a route either: a loaded LoRA adapter can be replaced in place under its own name (a load
# with `upsert`, or a push of its wire-named tensors); our engines declare it, SGLang does not
LORA_UPSERT = "lora_upsert"
# the routes of our engine server over HTTP
SERVER_ROUTES = frozenset({SHARED_MEMORY, DISK, DISTRIBUTED, PAUSED_PUSH, LORA_UPSERT})
# the route of an engine in the trainer's own process
IN_PROCESS_ROUTES = frozenset({TENSOR, LORA_UPSERT})


class ProcessUnavailable(RuntimeError):
    """The process died, hangs, or cannot be reached."""


EngineUnavailable = ProcessUnavailable  # the engine process died, hangs, or cannot be reached


class EngineRequestRejected(ValueError):
    """The engine answered 4xx: the request itself is wrong."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine offers the runtime: in-process (embedded, serving), over HTTP (our
    engine server, SGLang), behind a router."""

    weight_routes: frozenset[str]  # how this engine takes new weights (see the module doc)
    # whether each request is sampled from its own `sampling_seed` (continuous batching: a
    # request's draws must not depend on its batch neighbours); False: one shared generator
    per_request_seeds: bool
    # optional: `generator`, the torch.Generator an in-process engine samples unseeded requests
    # from (see `shared_generator`)

    @property
    def weight_version(self) -> int: ...

    def set_weight_version(self, version: int) -> None: ...

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]: ...

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...

    def load_counters(self) -> dict[str, float]:
        """Cumulative counters: `steps` (forward steps), `running_sum` and `waiting_sum` (the
        requests decoding / queued, summed over steps); {} if the engine does not report them.
        Differences across a rollout give its mean active requests and queue depth."""
        ...

    def weights_checksum(self, scope: str = "all") -> str:
        """sha256 (weights/checker.py order) of the weights that generate: an engine that
        decodes from derived copies (packed, fused) verifies them against these first.
        `scope`: all, base (the model's tensors) or adapters (LoRA adapters, wire names)."""
        ...

    def close(self) -> None: ...


def shared_generator(engine) -> Any:
    """The `torch.Generator` an in-process engine samples unseeded requests from (its optional
    `generator` attribute), or None (engines out of process, or none declared). A checkpoint
    keeps its state, a resume restores it, an evaluation puts it back as it was."""
    return getattr(engine, "generator", None)


class TensorEngine(RolloutEngine, Protocol):
    """The `tensor` route: an engine in the trainer's process."""

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Loads tensors by HF name, all or nothing; returns the bytes copied."""
        ...

    def named_tensors(self) -> dict[str, Any]: ...


class ServerEngine(RolloutEngine, Protocol):
    """The server routes (`shared_memory`, `disk`, `distributed`): a client of an engine server."""

    url: str

    def post(self, path: str, body: dict | None = None) -> dict: ...

    def server_info(self, timeout: float | None = None) -> dict: ...

    def update_weights_from_shared_memory(
        self, descriptions: list[str], version: int | None = None, flush_cache: bool = True
    ) -> None: ...

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None: ...


def require_route(engines: Iterable, route: str, transport: str) -> list:
    """The engines, if every one takes weights by `route`; else a clear error naming the
    transport, the engine and the routes it does take."""
    engines = list(engines)
    for e in engines:
        routes = frozenset(getattr(e, "weight_routes", ()))
        if route not in routes:
            where = getattr(e, "url", None) or type(e).__name__
            hint = (
                "; this engine runs in the trainer's process — use transport 'colocated'"
                if TENSOR in routes
                else ""
            )
            raise ValueError(
                f"weight transport {transport!r} needs engines that take weights by {route!r}; "
                f"engine {where} takes {sorted(routes) or 'none'}{hint}"
            )
    return engines
