"""The `train:` section: the trainer backend, its layout, the optimizer and the loss."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_core.config.base import PluginOptionsField, Strict, options_field, plugin_validators
from miles_core.config.distill import DistillSettings
from miles_core.config.lora import LoraSettings
from miles_core.config.offload import OffloadSettings


def _registry(name: str):
    """A trainer registry, imported when a config is validated (the trainer's modules load
    torch)."""
    from miles_core.train.advantage import ADVANTAGES
    from miles_core.train.advantage_transform import ADVANTAGE_TRANSFORMS
    from miles_core.train.backend import BACKENDS
    from miles_core.train.loss import LOSSES

    return {
        "BACKENDS": BACKENDS,
        "LOSSES": LOSSES,
        "ADVANTAGES": ADVANTAGES,
        "ADVANTAGE_TRANSFORMS": ADVANTAGE_TRANSFORMS,
    }[name]


class ParallelConfig(Strict):
    """How a Megatron trainer splits the model over its ranks (train.backend: megatron; FSDP2
    is data parallel only). tp × pp × cp × dp = train.world_size; dp defaults to what the
    others leave. ep splits a mixture-of-experts model's experts over data-parallel ranks."""

    tp: int = Field(1, ge=1, description="tensor parallel: heads, MLP columns, vocabulary")
    pp: int = Field(1, ge=1, description="pipeline parallel: consecutive layers per stage")
    cp: int = Field(1, ge=1, description="context parallel (needs TransformerEngine: 1 here)")
    dp: int | None = Field(None, ge=1, description="data parallel; default: what is left")
    ep: int = Field(
        1,
        ge=1,
        description="expert parallel (MoE models): each of ep data-parallel ranks holds 1/ep of "
        "every layer's routed experts and runs them for the tokens of all ep",
    )
    etp: int | None = Field(
        None,
        ge=1,
        description="expert tensor parallel: each expert's columns split over etp ranks "
        "(Megatron-core: etp × ep × expert-dp × pp = world_size); default tp",
    )
    pp_layers: list[int] | None = Field(
        None,
        description="layers of each pipeline stage, first to last (an uneven split, e.g. a "
        "last stage that also holds the output layer); default: layers / pp each",
    )

    @field_validator("pp_layers")
    @classmethod
    def _positive_stages(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(n < 1 for n in v):
            raise ValueError(f"pp_layers must be positive layer counts, got {v}")
        return v

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(32, gt=0)
    share_prompts: bool = Field(
        True,
        description="the training forward runs each distinct prompt of a micro-batch once and "
        "its samples' responses attend to its keys and values (exact: the same log-probs and "
        "gradients as one padded row per sample, up to rounding); off: one padded row each",
    )
    world_size: int = Field(
        1, gt=0, description="trainer ranks; >1 runs under torchrun (gloo on CPU)"
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads per process (default: all cores)"
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    offload: OffloadSettings = Field(default_factory=OffloadSettings)

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each trains a share of the batch."""
        return self.world_size // self.parallel.model_parallel

    @model_validator(mode="after")
    def _layout_fits(self) -> OptimConfig:
        from miles_core.train.backends.megatron.layout import resolve_layout

        resolve_layout(self.parallel.model_dump(), self.world_size)  # ValueError naming sizes
        return self

    @model_validator(mode="after")
    def _lr_floor(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class TrainConfig(OptimConfig):
    backend: str = Field(
        "fsdp",
        description="trainer backend: a registered name (fsdp; more with "
        "a module in miles_core/train/backends/) or 'package.module:Class'",
    )
    backend_options: PluginOptionsField = options_field("backend")
    loss: str = Field(
        "policy",
        description="loss of the RL step: a module of miles_core/train/losses/ (policy: "
        "PPO-clip with KL, entropy and off-policy corrections) or 'package.module:object'",
    )
    loss_options: PluginOptionsField = options_field("loss")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the trainer runs: cuda (bf16 compute, fp32 params and gradient "
        "reduction; nccl between ranks), cpu (fp32, gloo), auto = cuda when available",
    )
    num_steps: int = Field(50, gt=0, description="rollout → train → weight update iterations")
    global_batch_size: int = Field(
        128,
        gt=0,
        description="rollouts per optimizer step (a sample each; an agent episode's leaves "
        "count once and stay in one step)",
    )
    advantage_estimator: str = Field(
        "grpo",
        description="advantages from a group's rewards: a module of "
        "miles_core/train/advantages/ (grpo, rloo) or 'package.module:Class'",
    )
    advantage_estimator_options: PluginOptionsField = options_field("advantage_estimator")
    advantage_transforms: dict[str, PluginOptionsField] = Field(
        default_factory=dict,
        description="per-token changes to the estimator's advantages, applied in order: a "
        "module of miles_core/train/advantage_transforms/ (opd) or 'package.module:Class', "
        "each with its options",
    )
    routing_replay: bool = Field(
        False,
        description="MoE models (R3): the trainer's routers take the experts the engine routed "
        "each token to at rollout, in the old-log-prob and the training forward; the router "
        "still computes its scores and gets gradients",
    )
    true_on_policy: bool = Field(
        False,
        description="the engine and the trainer run one batch-invariant forward "
        "(miles_core/true_on_policy/), so train/train_rollout_logprob_abs_diff is exactly 0; "
        "turns train.share_prompts off unless it is set",
    )
    qat: bool = Field(
        False,
        description="quantization-aware training: the forward uses the quantized values the "
        "engine serves (rollout.precision, precision.keep_bf16), gradients pass straight "
        "through to the float weights",
    )
    lora: LoraSettings | None = Field(
        None,
        description="train LoRA adapters on the frozen base instead of the model (peft; only the "
        "adapters get gradients and optimizer state, and only they are pushed to the engines, "
        "which serve them per request, unmerged)",
    )
    distill: DistillSettings | None = Field(
        None,
        description="on-policy distillation: teachers served as engines score the student's "
        "sampled tokens, and Â = A − coef · (log π_student − log π_teacher) per token (with "
        "train.advantage_estimator none: pure distillation)",
    )
    check_routing_replay: bool = Field(
        False,
        description="MoE models: compare, per token and MoE layer, the experts the trainer's "
        "router would pick with the engine's (train/routing_mismatch_fraction); without "
        "routing_replay it measures how often rollout and training route apart",
    )

    @model_validator(mode="before")
    @classmethod
    def _true_on_policy_defaults(cls, data: Any) -> Any:
        """The mode's forward has no shared-prompt path: off unless the config sets it (then
        the contract refuses it, naming it)."""
        if isinstance(data, dict) and data.get("true_on_policy") and "share_prompts" not in data:
            data = {**data, "share_prompts": False}
        return data

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> TrainConfig:
        unit = self.micro_batch_size * self.dp_world
        if self.global_batch_size % unit:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"micro_batch_size × data-parallel ranks ({unit})"
            )
        if self.lora is not None:
            from miles_core.train.backend import BACKENDS

            refused = getattr(BACKENDS.get(self.backend), "lora_refused", None)
            if refused:
                raise ValueError(f"train.lora with train.backend {self.backend}: {refused}")
            if self.qat:
                raise ValueError(
                    "train.lora with train.qat: adapters over a fake-quantized base are not "
                    "built yet; use one or the other"
                )
        p = self.parallel
        if p.model_parallel > 1 or p.ep > 1:
            from miles_core.train.backend import BACKENDS

            if not getattr(BACKENDS.get(self.backend), "model_parallel", False):
                raise ValueError(
                    f"train.parallel asks for tp={p.tp}, pp={p.pp}, cp={p.cp}, ep={p.ep}: "
                    f"train.backend {self.backend} is data parallel only (megatron splits models)"
                )
        return self

    _backend, _backend_options = plugin_validators("backend", lambda: _registry("BACKENDS"))
    _loss, _loss_options = plugin_validators("loss", lambda: _registry("LOSSES"))
    _advantages, _advantages_options = plugin_validators(
        "advantage_estimator", lambda: _registry("ADVANTAGES")
    )

    @field_validator("advantage_transforms", mode="before")
    @classmethod
    def _transforms_known(cls, raw: Any) -> dict[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise ValueError(f"advantage_transforms must be a mapping of name → options: {raw!r}")
        registry = _registry("ADVANTAGE_TRANSFORMS")
        return {registry.check(n): registry.options(n, options) for n, options in raw.items()}

    @field_validator("device")
    @classmethod
    def _device_present(cls, v: str) -> str:
        if v == "cuda":  # only then import torch: validating a config stays cheap
            from miles_core.device import check_device

            check_device(v)
        return v
