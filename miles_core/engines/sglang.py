"""Real SGLang servers: launched from their own Python environment, or attached by address.

SGLang pins its own torch/CUDA stack, so it cannot live in our venv; on a GPU host it runs from
its own environment, which is how Miles uses it too. `SGLangLaunch` maps our engine settings to
`python -m sglang.launch_server` flags (checked against SGLang's ServerArgs field names in
tests/contract); `SGLangProcess` starts it with that interpreter on 127.0.0.1, waits for
`/health_generate` and stops it by PID. Either way the runtime talks to it with `HttpEngine`,
exactly as to our own engine server; `attach` declares the weight routes the server takes (ours
lists them in `/get_model_info`; SGLang: disk and a distributed group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from miles_core.engines.http import EngineUnavailable, HttpEngine
from miles_core.engines.protocol import DISK, DISTRIBUTED
from miles_core.processes.auth import bearer
from miles_core.processes.managed import ManagedProcess
from miles_core.processes.ports import PortRange


@dataclass
class SGLangLaunch:
    python: str  # the interpreter of the environment SGLang is installed in
    model_path: str
    port: int = 0
    host: str = "127.0.0.1"
    tp_size: int = 1
    ep_size: int = 1
    dtype: str = "auto"
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    random_seed: int | None = None
    enable_memory_saver: bool = False  # needed for release/resume_memory_occupation (colocated)
    skip_tokenizer_init: bool = True  # we send token ids and read output_ids
    # SGLang's --api-key (Authorization: Bearer on its routes); it takes the key only on its
    # command line, which `ps` shows
    api_key: str | None = None
    # LoRA adapters served per request (`serve_adapters`): the largest rank, the leaf names of
    # the adapted modules, the most adapters loaded at once
    max_lora_rank: int | None = None
    lora_target_modules: list[str] = field(default_factory=list)
    max_loaded_loras: int | None = None
    extra_args: list[str] = field(default_factory=list)  # e.g. what a token field needs

    def serve_adapters(self, spec: dict | None) -> SGLangLaunch:
        """Serves the adapters of a LoRA run's engine spec (lora/adapter.py: engine_spec; None:
        none): `--enable-lora` with their largest rank and modules, and its adapter limit."""
        if spec is None:
            return self
        configs = list(spec["adapters"].values())
        self.max_lora_rank = max(int(c["r"]) for c in configs)
        leaves = {m.rsplit(".", 1)[-1] for c in configs for m in c["target_modules"]}
        self.lora_target_modules = sorted(leaves)
        self.max_loaded_loras = int(spec["max_loaded"])
        return self

    def command(self) -> list[str]:
        args = [self.python, "-m", "sglang.launch_server"]
        values = {
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "tp_size": self.tp_size,
            "ep_size": self.ep_size if self.ep_size > 1 else None,
            "dtype": self.dtype,
            "context_length": self.context_length,
            "mem_fraction_static": self.mem_fraction_static,
            "max_running_requests": self.max_running_requests,
            "random_seed": self.random_seed,
            "api_key": self.api_key,
            "max_lora_rank": self.max_lora_rank,
            "max_loaded_loras": self.max_loaded_loras,
        }
        for name, value in values.items():
            if value is not None:
                args += [flag(name), str(value)]
        for name in ("enable_memory_saver", "skip_tokenizer_init"):
            if getattr(self, name):
                args.append(flag(name))
        if self.max_lora_rank is not None:
            args.append(flag("enable_lora"))
        if self.lora_target_modules:
            args += [flag("lora_target_modules"), *self.lora_target_modules]
        return args + list(self.extra_args)


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class SGLangProcess(ManagedProcess):
    """One `sglang.launch_server` subprocess, healthy once it generates, stopped by PID."""

    what = "SGLang"
    health_path = "/health_generate"
    health_poll_s = 1.0

    def __init__(
        self,
        launch: SGLangLaunch,
        log_path: str | Path | None = None,
        port_range: PortRange | str | None = None,
    ):
        # SGLang binds the port it is given: probed here (inside `port_range` when set)
        super().__init__(
            port=launch.port or None,
            log_path=log_path,
            host=launch.host,
            port_range=port_range,
            api_key=launch.api_key,  # for our health probe; SGLang reads it from its flag
        )
        launch.port = self.port
        self.launch = launch

    def command(self) -> list[str]:
        return self.launch.command()

    def start(self, timeout: float = 900.0) -> SGLangProcess:
        if not Path(self.launch.python).exists():
            raise FileNotFoundError(f"SGLang interpreter {self.launch.python!r} not found")
        return super().start(timeout)


def attach(
    urls: list[str],
    expected_model: str | None = None,
    timeout: float = 10.0,
    api_key: str | None = None,
) -> list[HttpEngine]:
    """Clients for already-running servers (SGLang's or ours); refuses unreachable ones and, when
    `expected_model` is given, servers that serve another model. `api_key`: the servers' key."""
    engines = []
    for url in urls:
        try:
            r = httpx.get(
                f"{url.rstrip('/')}/get_model_info", headers=bearer(api_key), timeout=timeout
            )
            info = r.json() if r.status_code != 401 else None
        except (httpx.HTTPError, ValueError) as e:
            raise EngineUnavailable(f"cannot attach to engine at {url}: {e!r}") from e
        if info is None:
            raise EngineUnavailable(f"engine at {url} refused the key (HTTP 401): pass its api_key")
        if expected_model is not None and info.get("model_path") != expected_model:
            raise ValueError(
                f"engine at {url} serves {info.get('model_path')!r}, expected {expected_model!r}"
            )
        engines.append(HttpEngine(url, weight_routes=server_routes(info), api_key=api_key))
    return engines


# SGLang loads from disk and over a group (/dev/shm buckets are our engine server's route), and
# loads an adapter only under a name it does not hold (no LORA_UPSERT: lora/versions.py)
SGLANG_ROUTES = frozenset({DISK, DISTRIBUTED})


def server_routes(model_info: dict) -> frozenset[str]:
    """The weight routes a server declares in `/get_model_info` (ours lists `weight_routes`);
    SGLang's when it declares none."""
    declared = model_info.get("weight_routes")
    return frozenset(declared) if declared else SGLANG_ROUTES
