"""The whole run configuration (`RunConfig`): every section, and the checks across them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from miles_core.config.agent import AgentConfig
from miles_core.config.base import Strict, in_trainer_process
from miles_core.config.checkpoint import CheckpointConfig
from miles_core.config.cluster import ClusterConfig
from miles_core.config.data import DataConfig
from miles_core.config.diffusion import DiffusionConfig
from miles_core.config.eval import EvalConfig
from miles_core.config.model import ModelConfig
from miles_core.config.network import NetworkConfig
from miles_core.config.precision import PrecisionConfig
from miles_core.config.rollout import RolloutConfig
from miles_core.config.sft import SFTConfig
from miles_core.config.tracking import TrackingConfig
from miles_core.config.train import TrainConfig
from miles_core.config.weight_sync import WeightSyncConfig
from miles_core.models import moe
from miles_core.rollout.mode import MODES
from miles_core.train.advantage import ADVANTAGES


class RunConfig(Strict):
    name: str = Field(
        "miles-run",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="run name: checkpoint folder and registered-model name (letters, digits, _ . -)",
    )
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    sft: SFTConfig | None = Field(None, description="supervised warm start before RL")
    agent: AgentConfig = Field(default_factory=AgentConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    diffusion: DiffusionConfig | None = Field(
        None, description="an image run: a flow-matching image model and an image loss"
    )

    @model_validator(mode="before")
    @classmethod
    def _sft_shares_the_trainer(cls, data: Any) -> Any:
        """An `sft:` section without its own `world_size` / `parallel` takes the trainer's (they
        share the ranks and the layout; different ones set explicitly are refused below)."""
        if not isinstance(data, dict):
            return data
        sft, train = data.get("sft"), data.get("train")
        if isinstance(sft, dict) and isinstance(train, dict):
            shared = {
                k: train[k] for k in ("world_size", "parallel") if k in train and k not in sft
            }
            if shared:
                data = {**data, "sft": {**sft, **shared}}
        return data

    def _check_transport_fits_engine(self) -> None:
        """The transport's weight route must be one the engine takes (both from registries)."""
        from miles_core.engines.registry import ENGINES
        from miles_core.weights.transport import TRANSPORTS

        r, ws = self.rollout, self.weight_sync
        need, routes = TRANSPORTS.get(ws.transport).route, ENGINES.get(r.engine).routes
        if need not in routes:
            fitting = [n for n in TRANSPORTS.names() if TRANSPORTS.get(n).route in routes]
            server = not in_trainer_process(r.engine)
            hint = "" if server else " (or set rollout.engine: server)"
            raise ValueError(
                f"rollout.engine: {r.engine} needs weight_sync.transport {' | '.join(fitting)}"
                f"{hint}: {ws.transport} loads weights by {need!r}, the engine takes "
                f"{sorted(routes)}"
            )

    @model_validator(mode="after")
    def _cluster_runs_it(self) -> RunConfig:
        """The cluster backend runs this kind of run (`ClusterBackend.runs`)."""
        from miles_core.cluster.backend import CLUSTERS

        runs = CLUSTERS.get(self.cluster.backend).runs
        for kind, section, present in (
            ("sft", "an SFT warm start (sft:)", self.sft is not None),
            ("image", "an image run (diffusion:)", self.diffusion is not None),
        ):
            if present and kind not in runs:
                raise ValueError(
                    f"cluster.backend {self.cluster.backend!r} does not run {section} yet"
                )
        return self

    @model_validator(mode="after")
    def _batch_invariant(self) -> RunConfig:
        r, t = self.rollout, self.train
        if (t.routing_replay or t.check_routing_replay) and moe.PATH not in r.token_fields:
            r.token_fields.append(moe.PATH)  # what the trainer replays or checks against
        if self.agent.function is not None:  # the agent section checks its own settings
            self._check_agentic()
            if self.agent.eval_episodes and self.data.path:
                raise ValueError(
                    "agent.eval_episodes draws fixed tasks from data.task's generator; with "
                    "data.path set there is none: leave agent.eval_episodes at 0"
                )
        fewest = getattr(ADVANTAGES.get(t.advantage_estimator), "min_group", 1)
        if r.n_samples_per_prompt < fewest:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be at least {fewest} for "
                f"train.advantage_estimator {t.advantage_estimator} (its advantages compare a "
                "group's samples)"
            )
        samples = r.prompts_per_step * r.n_samples_per_prompt
        if samples % t.global_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step × n_samples_per_prompt ({samples}) must be divisible by "
                f"train.global_batch_size ({t.global_batch_size})"
            )
        self._check_modality()
        if self.diffusion is not None:
            return self
        self._check_transport_fits_engine()
        if t.distill is not None:
            t.distill.add_to(self)
        self._check_precision()
        self._check_lora()
        self._check_eval()
        if t.true_on_policy:
            from miles_core.true_on_policy.contract import TRUE_ON_POLICY

            refused = TRUE_ON_POLICY.settings_refused(self)
            if refused:
                raise ValueError(
                    f"train.true_on_policy ({TRUE_ON_POLICY.name}): {'; '.join(refused)}"
                )
            r.token_fields += [p for p in TRUE_ON_POLICY.token_fields() if p not in r.token_fields]
        if self.data.exclude_sft and self.sft is None:
            raise ValueError(
                "data.exclude_sft leaves the SFT warm start's examples out of the RL prompts: "
                "the run has no sft: section"
            )
        if self.sft is not None and self.sft.world_size != t.world_size:
            raise ValueError(
                "sft.world_size must equal train.world_size (they share the trainer ranks)"
            )
        if self.sft is not None and self.sft.parallel != t.parallel:
            raise ValueError(
                "sft.parallel must equal train.parallel (they share the trainer and its layout)"
            )
        return self

    def _check_modality(self) -> None:
        """An image loss needs a `diffusion:` section and a text loss none."""
        from miles_core.diffusion.loss import modality_of
        from miles_core.train.loss import LOSSES

        t, d = self.train, self.diffusion
        modality = modality_of(LOSSES.get(t.loss))
        if d is None:
            if modality == "image":
                raise ValueError(
                    f"train.loss {t.loss} trains an image model: add a diffusion: section"
                )
            return
        if modality != "image":
            image = [n for n in LOSSES.names() if modality_of(LOSSES.get(n)) == "image"]
            raise ValueError(
                f"train.loss {t.loss} is a text loss; an image run (diffusion:) trains with "
                f"{' | '.join(image)}"
            )
        d.check_run(self)

    def _check_agentic(self) -> None:
        """What an agentic run needs of the other sections; each refusal names the one setting
        that does not fit."""
        r, a = self.rollout, self.agent
        if in_trainer_process(r.engine):
            raise ValueError(
                "agent.function (agentic rollout) needs an engine server behind the session "
                f"server: rollout.engine: {r.engine} runs in the trainer's process; set "
                "rollout.engine: server"
            )
        if MODES.get(r.mode).ahead and r.pause_mode == "abort":
            raise ValueError(
                "rollout.pause_mode: abort ends the model calls in flight at each weight push, "
                "and an agent episode cannot continue a call it lost: agentic runs in "
                f"rollout.mode {r.mode} use retract or in_place"
            )
        if a.concurrency < r.n_samples_per_prompt:
            raise ValueError(
                f"agent.concurrency ({a.concurrency} episodes in flight) is below the group size "
                f"rollout.n_samples_per_prompt ({r.n_samples_per_prompt}): a GRPO group's "
                "episodes must be able to run together"
            )

    def _check_precision(self) -> None:
        """rollout.precision and train.qat against the engine, transport and trainer."""
        from miles_core.engines.registry import ENGINES
        from miles_core.precision.format import FORMATS

        r, t = self.rollout, self.train
        quantized = FORMATS.get(r.precision).quantizes
        if t.qat and not quantized:
            raise ValueError(
                "train.qat trains on the values the engine serves: set rollout.precision to a "
                "format (fp8, fp8_block, mxfp8, mxfp4, nvfp4, int4)"
            )
        if not quantized:
            return
        if not ENGINES.get(r.engine).quantized_weights:
            raise ValueError(
                f"rollout.precision {r.precision}: rollout.engine {r.engine} does not take "
                "quantized weights (embedded, serving and server do)"
            )
        if self.weight_sync.transport == "p2p" and t.backend == "megatron":
            raise ValueError(
                f"rollout.precision {r.precision} with weight_sync.transport p2p needs "
                "train.backend: fsdp (Megatron's tensor-parallel shards split the blocks a "
                "format scales over); use broadcast, shared_memory or disk"
            )
        if t.qat and t.backend == "megatron":
            raise ValueError(
                "train.qat: the megatron backend has no fake-quantized forward yet; use "
                "train.backend: fsdp"
            )
        if t.true_on_policy and not t.qat:
            raise ValueError(
                f"train.true_on_policy with rollout.precision {r.precision} needs train.qat: the "
                "trainer must compute with the quantized values the engine serves"
            )

    def _check_lora(self) -> None:
        """train.lora against the rollout: requests name the run's adapter."""
        r, lora = self.rollout, self.train.lora
        if lora is None:
            if r.adapter is not None:
                raise ValueError(f"rollout.adapter {r.adapter!r} is set but train.lora is not")
            return
        if r.adapter is None:
            r.adapter = lora.adapter
        elif r.adapter not in lora.adapters:
            raise ValueError(
                f"rollout.adapter {r.adapter!r} is none of train.lora.adapters {lora.adapters}"
            )
        if r.precision != "none":
            raise ValueError(
                f"train.lora with rollout.precision {r.precision}: adapters over a quantized "
                "base are not built yet"
            )
        if len(lora.adapters) > 1 and self.agent.function is not None:
            raise ValueError(
                "train.lora.adapters: several adapters with agent.function: an episode's "
                "session names one adapter for the whole run; train one adapter"
            )
        from miles_core.eval.mode import EVAL_MODES

        if EVAL_MODES.get(self.eval.mode).background:
            raise ValueError(
                f"train.lora with eval.mode {self.eval.mode}: evaluating saved adapters beside "
                "training is not built yet; use eval.mode shared (the run's own engines)"
            )
        from miles_core.engines.protocol import LORA_UPSERT
        from miles_core.engines.registry import ENGINES

        if LORA_UPSERT not in ENGINES.get(r.engine).routes:
            self._check_adapter_versions()

    def _check_adapter_versions(self) -> None:
        """train.lora on an engine that cannot replace an adapter in place: each push loads a
        new version of it and unloads the one before (lora/versions.py). What that cannot carry
        is refused, each refusal naming its setting."""
        from miles_core.weights.transport import TRANSPORTS

        r, ws = self.rollout, self.weight_sync
        why = (
            f"rollout.engine {r.engine} cannot replace a LoRA adapter in place, so each push "
            "loads a new version of it and unloads the one before"
        )
        if not TRANSPORTS.get(ws.transport).adapter_versions:
            fitting = [n for n in TRANSPORTS.names() if TRANSPORTS.get(n).adapter_versions]
            raise ValueError(
                f"weight_sync.transport {ws.transport} with train.lora: {why}, which "
                f"{ws.transport} cannot push (it replaces adapters in place); use "
                f"{' | '.join(fitting)}"
            )

        def generates_across_pushes(name: str) -> bool:
            mode = MODES.get(name)
            return mode.ahead and not mode.drains_before_push

        if generates_across_pushes(r.mode):
            fitting = [n for n in MODES.names() if not generates_across_pushes(n)]
            raise ValueError(
                f"rollout.mode {r.mode} with train.lora: {why}, and requests in flight across a "
                f"push would finish on the version it unloads; use {' | '.join(fitting)}"
            )
        if self.agent.function is not None:
            raise ValueError(
                f"agent.function with train.lora: {why}, and the session server names the "
                "adapter by its own name, not its current version"
            )
        if ws.check_equal:
            raise ValueError(
                f"weight_sync.check_equal with train.lora: {why}, and the weights check of such "
                "an engine (SGLang's) does not cover adapters"
            )

    def _check_eval(self) -> None:
        e, interval = self.eval, self.checkpoint.interval
        from miles_core.eval.mode import EVAL_MODES

        mode = EVAL_MODES.get(e.mode)
        if not mode.enabled:
            return
        if self.agent.function is not None:
            raise ValueError(
                "eval.mode is for task runs; agentic runs evaluate with agent.eval_episodes"
            )
        if mode.background and e.every:
            if not interval or e.every % interval:
                raise ValueError(
                    f"eval.mode {e.mode} evaluates saved checkpoints: eval.every ({e.every}) "
                    f"must be a multiple of checkpoint.interval ({interval})"
                )

    def with_start_model(self, path: str | None) -> RunConfig:
        """The same config starting from the model a checkpoint's run started from (`path`;
        None: as configured): a text run's HF directory, an image run's saved model (already
        pretrained)."""
        if path is None:
            return self
        if self.diffusion is None:
            return self.with_model_path(path)
        image = self.diffusion.model_copy(update={"model": path, "pretrain_steps": 0})
        return self.model_copy(update={"diffusion": image})

    def with_model_path(self, path: str | None) -> RunConfig:
        """The same config starting from the HF directory `path` (e.g. an SFT output)."""
        return self.model_copy(update={"model": self.model.model_copy(update={"path": path})})

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return (
            self.rollout.prompts_per_step
            * self.rollout.n_samples_per_prompt
            // self.train.global_batch_size
        )
