"""`sglang`: a real SGLang server behind the run, launched from its own Python environment
(`python`: SGLang pins its own torch/CUDA stack) on 127.0.0.1 and stopped by PID, or one that is
already running (`url`). The run talks to it with `HttpEngine`, the client of our own engine
server; weights travel by SGLang's routes (disk, a process group). It is not replaced when it
dies: the run fails, saying so. It cannot replace a LoRA adapter in place: each push is a new
version of it (lora/versions.py), what config/run.py checks a LoRA run for."""

from __future__ import annotations

from pydantic import Field, model_validator

from miles_core.engines.registry import ENGINES, BuiltEngine, EngineKind, EngineSetup
from miles_core.engines.sglang import SGLANG_ROUTES
from miles_core.models.moe import ROUTES
from miles_core.plugins import PluginOptions


class SGLangOptions(PluginOptions):
    python: str | None = Field(
        None, description="the interpreter of the environment SGLang is installed in: launch one"
    )
    url: str | None = Field(None, description="an SGLang server already running: attach to it")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs of a launched server")
    ep_size: int = Field(
        1, ge=1, description="expert-parallel size within those GPUs (MoE models; divides tp_size)"
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="GPU memory share of a launched server's weights and KV"
    )
    extra_args: list[str] = Field(
        default_factory=list, description="more sglang.launch_server flags, as on its command line"
    )
    start_timeout_s: float = Field(900.0, gt=0, description="how long a launch may take")

    @model_validator(mode="after")
    def _ep_within_tp(self) -> SGLangOptions:
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size})")
        return self

    @model_validator(mode="after")
    def _launch_or_attach(self) -> SGLangOptions:
        if (self.python is None) == (self.url is None):
            raise ValueError("give python (launch SGLang) or url (attach to a running server)")
        return self


@ENGINES.register("sglang")
class SGLang(EngineKind):
    routes = SGLANG_ROUTES
    answers = frozenset({ROUTES.request_flag})  # with --enable-return-routed-experts
    Options = SGLangOptions

    @classmethod
    def gpus_per_engine(cls, options: SGLangOptions) -> int:
        return options.tp_size

    @classmethod
    def layout_problems(cls, options: SGLangOptions, hf_config: dict) -> list[str]:
        from miles_core.models.check import moe_sizes

        bad = []
        heads = int(hf_config.get("num_attention_heads") or 0)
        if heads % options.tp_size:
            bad.append(
                f"num_attention_heads ({heads}) is not divisible by tp_size ({options.tp_size})"
            )
        experts = moe_sizes(hf_config).get("experts", 0)
        if options.ep_size > 1 and experts % options.ep_size:
            bad.append(f"its {experts} experts are not divisible by ep_size ({options.ep_size})")
        return bad

    @classmethod
    def gpu_share(cls, options: SGLangOptions) -> float | None:
        return options.mem_fraction_static

    @classmethod
    def build(cls, setup: EngineSetup) -> BuiltEngine:
        from miles_core.engines.http import HttpEngine
        from miles_core.engines.sglang import SGLangLaunch, SGLangProcess, attach

        o = setup.options
        if o.url is not None:
            [client] = attach([o.url], api_key=setup.api_key)
            return BuiltEngine(client)  # not ours to stop
        launch = SGLangLaunch(
            python=o.python,
            model_path=str(setup.model_dir),
            tp_size=o.tp_size,
            ep_size=o.ep_size,
            mem_fraction_static=o.mem_fraction_static,
            max_running_requests=setup.max_in_flight,
            random_seed=setup.seed,
            api_key=setup.api_key,
            extra_args=list(o.extra_args),
        ).serve_adapters(setup.lora)
        process = SGLangProcess(
            launch, log_path=setup.workdir / "sglang.log", port_range=setup.port_range
        )
        # started here, or by an actor where the run's cluster places it
        process = setup.start_process(process, 0, o.start_timeout_s)
        client = HttpEngine(
            process.url,
            concurrency=setup.max_in_flight,
            weight_routes=SGLANG_ROUTES,
            api_key=setup.api_key,
        )
        return BuiltEngine(client, [(process, client)])
