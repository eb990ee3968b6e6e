"""The run configuration: one pydantic tree, validated before anything starts.

The same object is the Prefect flow parameter (the UI renders it as a form), the YAML file a user
edits, and the flattened MLflow params of the run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_core.data.tasks import get_task


class _Strict(BaseModel):
    # allow_inf_nan=False: `train.lr: .inf` or a NaN anywhere in the tree is refused up front
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelConfig(_Strict):
    preset: Literal["tiny", "small", "medium", "tiny-moe", "small-moe", "tiny-moe-shared"] = Field(
        "tiny",
        description="architecture preset for a random init: dense Qwen3 (tiny, small, medium) "
        "or mixture of experts (tiny-moe, small-moe: Qwen3-MoE; tiny-moe-shared: GLM4-MoE "
        "with a shared expert)",
    )
    path: str | None = Field(
        None,
        description="HF directory to start from instead of a random init (local path, or an fsspec "
        "URL read with checkpoint.storage_options)",
    )
    seed: int = Field(0, description="seed of the random init")
    context: int | None = Field(
        None,
        gt=0,
        le=32768,
        description="a preset's context (max_position_embeddings; default 512), e.g. for long "
        "agent episodes; a model.path model keeps its own",
    )

    @model_validator(mode="after")
    def _context_for_presets(self) -> ModelConfig:
        if self.context is not None and self.path is not None:
            raise ValueError(
                "model.context sets a preset's context; the model at model.path keeps its own "
                "(max_position_embeddings in its config.json): leave model.context unset"
            )
        return self


class DataConfig(_Strict):
    task: str = Field(
        "say_a", description="built-in task (say_a, reverse, add) or 'package.module:object'"
    )
    path: str | None = Field(
        None, description="JSONL prompts (local path or fsspec URL); default: the task's generator"
    )
    num_prompts: int = Field(2048, gt=0, description="prompts to generate when no path is given")
    seed: int = 0
    shuffle: bool = True
    storage_options: dict[str, Any] = Field(default_factory=dict)
    exclude_sft: bool = Field(
        False,
        description="RL prompts that are none of the sft: warm start's examples (RL then works on "
        "tasks the SFT never showed, as the held-out evaluation does); a generator draws more "
        "to keep num_prompts, a data.path file's matching rows are left out",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        get_task(v)  # raises ValueError with the list of known tasks
        return v


def _in_trainer_process(engine: str) -> bool:
    """Whether engine `engine` runs in the trainer's process (it takes weights only as tensors
    handed over there, engine_api.IN_PROCESS_ROUTES), as opposed to an engine server."""
    from miles_core.engines.protocol import IN_PROCESS_ROUTES
    from miles_core.engines.registry import engine_routes

    return engine_routes(engine) <= IN_PROCESS_ROUTES


class RolloutConfig(_Strict):
    engine: str = Field(
        "embedded",
        description="a registered engine (miles_core/engines/registry.py) or 'package.module:factory'. "
        "embedded: batched sampler on the HF modules; serving: continuous batching with prefix "
        "reuse (GRPO siblings share the prompt's KV), per-request seeds; server: the serving "
        "engine as a subprocess on 127.0.0.1 behind SGLang's HTTP API (weights travel by "
        "weight_sync.transport shared_memory, disk or broadcast)",
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads of the engine server process (default: all cores)"
    )
    mode: Literal["sync", "one_step_off", "fully_async"] = Field(
        "sync",
        description="sync: generate, then train; one_step_off: the next batch is generated "
        "while the trainer trains (weights pushed between batches); fully_async: a producer "
        "keeps the engine busy, weights pushed any time (needs rollout.engine: server)",
    )
    watchdog_s: float = Field(
        60.0,
        gt=0,
        description="async modes: when no rollout group completes for this long, the run logs "
        "what it waits on (again every watchdog_s)",
    )
    health_interval_s: float = Field(
        1.0,
        gt=0,
        description="engine: server: seconds between heartbeats (/health, and whether the "
        "process still runs; an exited process is replaced at once)",
    )
    health_timeout_s: float = Field(
        6.0,
        gt=0,
        description="engine: server: an engine without a healthy /health answer for this long "
        "(hung, e.g. SIGSTOP) is killed and replaced; must exceed health_interval_s",
    )
    num_engines: int = Field(
        1,
        ge=1,
        le=64,
        description="engine: server: engine server processes; more than one sit behind "
        "sglang-router, with a request's routing key (an agent session's id) sticking to one",
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        description="engine: server: most engine replacements (attempts) in a run; the next "
        "death fails the run (0: a dead engine fails the run at once)",
    )
    max_staleness: int = Field(
        1, ge=0, description="fully_async: most policy versions a sample may lag the trainer"
    )
    stale_policy: Literal["pace", "drop", "retry"] = Field(
        "pace",
        description="fully_async: pace admission so no sample exceeds max_staleness (default), "
        "or admit freely and drop / requeue stale groups",
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="how a weight push pauses generation on the engine"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="serving engine compute dtype; bfloat16 decodes faster on CPUs with bf16 "
        "units, its log-probs differ from the fp32 trainer's by ~1e-2 (train_rollout_* metrics)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the serving engine (rollout.engine serving or server) keeps its "
        "weights and KV cache: cpu, cuda, or auto = cuda when available; the embedded engine "
        "runs on the CPU",
    )
    prompts_per_step: int = Field(
        16, gt=0, description="prompts sampled per rollout (rollout batch size)"
    )
    n_samples_per_prompt: int = Field(8, gt=0, description="GRPO group size")
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a reward function (task.score) running longer fails its sample (reward 0, "
        "nothing trained)",
    )
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 disables top-k")
    seed: int = 0
    token_fields: list[str] = Field(
        default_factory=list,
        description="declared per-token fields the engine's responses carry to the trainer "
        "(import paths pkg.mod:FIELD of miles_core.token_fields.TokenField objects)",
    )
    return_routed_experts: bool = Field(
        False,
        description="MoE models: ask the engine for the experts each token was routed to "
        "(SGLang's return_routed_experts; samples carry them as the routed_experts field); "
        "on by itself with train.routing_replay or train.check_routing_replay",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        from miles_core.engines.registry import engine_routes

        engine_routes(v)  # ValueError naming the registered engines; imports an import path
        return v

    @field_validator("token_fields")
    @classmethod
    def _token_fields_load(cls, paths: list[str]) -> list[str]:
        from miles_core.token_fields import load_token_fields

        load_token_fields(paths)  # imports and declares them: a clear error before anything runs
        return paths

    @model_validator(mode="after")
    def _dtype_needs_serving(self) -> RolloutConfig:
        if self.mode != "sync" and _in_trainer_process(self.engine):  # async needs a server
            raise ValueError(f"rollout.mode {self.mode} needs rollout.engine: server")
        if self.dtype != "float32" and self.engine == "embedded":
            raise ValueError(f"rollout.dtype {self.dtype} needs rollout.engine: serving or server")
        if self.device == "cuda":
            if self.engine == "embedded":
                raise ValueError("rollout.device cuda needs rollout.engine: serving or server")
            from miles_core.device import check_device

            check_device(self.device)  # a clear error on a machine without CUDA
        return self

    @model_validator(mode="after")
    def _health_bounds(self) -> RolloutConfig:
        if self.health_timeout_s <= self.health_interval_s:
            raise ValueError(
                f"rollout.health_timeout_s ({self.health_timeout_s}) must exceed "
                f"rollout.health_interval_s ({self.health_interval_s}): an engine is declared "
                "dead after several missed heartbeats"
            )
        return self


class ParallelConfig(_Strict):
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

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


class OptimConfig(_Strict):
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

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each trains a share of the batch."""
        return self.world_size // self.parallel.model_parallel

    @model_validator(mode="after")
    def _layout_fits(self) -> OptimConfig:
        from miles_core.train.megatron.layout import resolve_layout

        resolve_layout(self.parallel.model_dump(), self.world_size)  # ValueError naming sizes
        return self

    @model_validator(mode="after")
    def _lr_floor(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class OffPolicyConfig(_Strict):
    mode: Literal["none", "tis", "icepop", "mis"] = Field(
        "none",
        description="importance correction for π_old/π_rollout: tis truncates the ratio, icepop "
        "masks tokens outside [low, high], mis weights at `level` with truncate or mask",
    )
    low: float = Field(0.0, ge=0, description="lower bound of the ratio band")
    high: float = Field(2.0, gt=0, description="upper bound of the ratio band")
    level: Literal["token", "sequence", "geometric"] = "token"
    mis_mode: Literal["truncate", "mask"] = "truncate"
    veto_threshold: float | None = Field(
        None, gt=0, lt=1, description="mis: reject a sequence holding a token ratio below this"
    )

    @model_validator(mode="after")
    def _band(self) -> OffPolicyConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class TrainConfig(OptimConfig):
    backend: str = Field(
        "fsdp",
        description="trainer backend: a registered name (fsdp; more with "
        "miles_core.train.registry.register_backend) or 'package.module:Class'",
    )
    loss: str = Field(
        "policy",
        description="loss of the RL step: a registered name (policy: PPO-clip/GRPO) or "
        "'package.module:object'",
    )
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
    advantage_estimator: Literal["grpo"] = "grpo"
    normalize_advantage_std: bool = True
    eps_clip: float = Field(0.2, gt=0, lt=1)
    eps_clip_high: float | None = Field(
        None, gt=0, description="upper clip (DAPO clip-higher); default eps_clip"
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "rollout_mean_token_mean"] = Field(
        "token_mean",
        description="token_mean: over all tokens; seq_mean_token_mean: per sample, then over "
        "samples; rollout_mean_token_mean: per rollout (samples sharing a rollout id, e.g. one "
        "agent session's leaves), then over rollouts",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="k3 KL to the initial policy; 0 disables the reference model"
    )
    entropy_coef: float = Field(0.0, ge=0)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    routing_replay: bool = Field(
        False,
        description="MoE models (R3): the trainer's routers take the experts the engine routed "
        "each token to at rollout, in the old-log-prob and the training forward; the router "
        "still computes its scores and gets gradients",
    )
    check_routing_replay: bool = Field(
        False,
        description="MoE models: compare, per token and MoE layer, the experts the trainer's "
        "router would pick with the engine's (train/routing_mismatch_fraction); without "
        "routing_replay it measures how often rollout and training route apart",
    )

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> TrainConfig:
        unit = self.micro_batch_size * self.dp_world
        if self.global_batch_size % unit:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"micro_batch_size × data-parallel ranks ({unit})"
            )
        if (self.parallel.model_parallel > 1 or self.parallel.ep > 1) and self.backend == "fsdp":
            raise ValueError(
                f"train.parallel asks for tp={self.parallel.tp}, pp={self.parallel.pp}, "
                f"cp={self.parallel.cp}, ep={self.parallel.ep}: train.backend fsdp is data "
                "parallel only (use megatron)"
            )
        return self

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from miles_core.train.registry import check_backend

        return check_backend(v)  # ValueError naming the registered backends

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from miles_core.train.registry import check_loss

        return check_loss(v)

    @field_validator("device")
    @classmethod
    def _device_present(cls, v: str) -> str:
        if v == "cuda":  # only then import torch: validating a config stays cheap
            from miles_core.device import check_device

            check_device(v)
        return v


class SFTConfig(OptimConfig):
    task: str = "reverse"
    path: str | None = Field(
        None,
        description="JSONL rows with 'prompt' and 'answer'; default: the task's demonstrations",
    )
    num_examples: int = Field(4096, gt=0)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    num_steps: int = Field(200, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = 0
    reuse: str | None = Field(
        None,
        description="the HF directory an earlier SFT run of this section saved (its run's "
        "checkpoint, e.g. <checkpoint.root>/<name>-sft/step_<n>): RL starts from it instead "
        "of training it again, e.g. to compare RL seeds after one warm start; its examples "
        "still count as training data (no evaluation task is one of them)",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        get_task(v)
        return v

    @model_validator(mode="after")
    def _divides(self) -> SFTConfig:
        unit = self.micro_batch_size * self.dp_world
        if self.batch_size % unit:
            raise ValueError(
                f"sft.batch_size ({self.batch_size}) must be divisible by micro_batch_size × data-parallel ranks ({unit})"
            )
        return self


class WeightSyncConfig(_Strict):
    transport: str = Field(
        "colocated",
        description="colocated (engine in the trainer's process); shared_memory, disk or broadcast (engine "
        "servers, rollout.engine: server)",
    )
    bucket_mb: int = Field(64, gt=0)
    disk_root: str | None = Field(
        None, description="disk transport: fsspec root for pushed weights (default: a temp dir)"
    )
    keep_versions: int = Field(2, ge=1, description="disk transport: pushed versions kept")
    disk_delta: bool = Field(
        False,
        description="disk transport: after the first push, write only changed tensors, encoded "
        "against the previous push (small with weight_sync.dtype: bfloat16)",
    )
    check_equal: bool = Field(
        False, description="verify engine weights bitwise after every push (slow)"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of pushed weights: float32 is exact; bfloat16 halves the bytes and "
        "keeps disk deltas small, and engines then hold bf16-rounded weights (a train/rollout "
        "mismatch that train.off_policy corrects and train_rollout_* metrics show)",
    )

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, v: str) -> str:
        from miles_core.weights import transport_route

        transport_route(v)  # raises ValueError naming the registered transports; builds nothing
        return v


class CheckpointConfig(_Strict):
    root: str = Field(
        default_factory=lambda: os.environ.get("MILES_CHECKPOINT_ROOT", "checkpoints"),
        description="fsspec root: a local path or s3://bucket/prefix (default: "
        "$MILES_CHECKPOINT_ROOT, else ./checkpoints)",
    )
    interval: int = Field(0, ge=0, description="save every N steps; 0 saves only at the end")
    storage_options: dict[str, Any] = Field(default_factory=dict)
    overwrite: bool = Field(
        False,
        description="a new run (not --resume) whose name already has checkpoints under root "
        "replaces them; false: such a run is refused before anything starts",
    )


class TrackingConfig(_Strict):
    experiment: str = "miles"
    tracking_uri: str | None = Field(
        None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"
    )
    run_name: str | None = None
    register_policy: bool = Field(
        True, description="record each checkpoint as a registered model version"
    )
    flush_interval_s: float = Field(
        5.0,
        ge=0,
        description="at most one metrics write per this many seconds (on the step loop's "
        "thread; a step longer than this writes at once); 0 writes every step",
    )


class EvalConfig(_Strict):
    """Evaluation of the policy on fixed prompts of data.task while training runs."""

    mode: Literal["none", "shared", "dedicated", "external"] = Field(
        "none",
        description="shared: pause the producer and evaluate on the rollout engine between "
        "steps; dedicated: a separate engine server loaded from the version's checkpoint, "
        "training keeps going; external: POST the checkpoint URI and version to eval.url and "
        "poll for the result; none: no evaluation",
    )
    every: int = Field(
        0,
        ge=0,
        description="evaluate the policy after every N training steps (and after the last); "
        "dedicated/external evaluate checkpoints, so N must be a multiple of "
        "checkpoint.interval; 0 = after the last step only",
    )
    prompts: int = Field(32, gt=0, description="fixed evaluation prompts (data.task's generator)")
    seed: int = Field(1_000_003, description="seed of the evaluation prompts (added to data.seed)")
    max_new_tokens: int | None = Field(None, gt=0, description="default: rollout.max_new_tokens")
    greedy: bool = Field(True, description="greedy decoding (top_k 1); false samples as rollout")
    timeout_s: float = Field(
        300.0, gt=0, description="an evaluation running longer is logged as failed (eval/errors)"
    )
    max_in_flight: int = Field(
        2, ge=1, description="dedicated/external: more pending evaluations are skipped (logged)"
    )
    url: str | None = Field(
        None, description="external: the evaluation service (POST {url}, GET {url}/{id})"
    )
    poll_s: float = Field(1.0, gt=0, description="external: seconds between polls")

    @model_validator(mode="after")
    def _url_for_external(self) -> EvalConfig:
        if (self.mode == "external") != bool(self.url):
            raise ValueError("eval.url and eval.mode: external go together")
        return self


RUN_COMMAND = "miles_core.agents.blackbox:run_command"  # the agent function of agent.command


class SandboxConfig(_Strict):
    """Per-command sandbox limits of a sandbox environment's episodes (`envs/sandbox.py`);
    unset fields keep the task's own (SandboxTasks limits), else the sandbox's defaults."""

    cpu_s: int | None = Field(None, gt=0, description="CPU seconds per command")
    wall_s: float | None = Field(None, gt=0, description="wall-clock seconds per command")
    memory_mb: int | None = Field(None, gt=0, description="address space per command (MiB)")
    processes: int | None = Field(None, gt=0, description="processes (enforced as root)")
    file_mb: int | None = Field(None, gt=0, description="largest file a command may write (MiB)")

    def overrides(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class AgentConfig(_Strict):
    """Agentic rollout: every sample is an agent episode recorded by the session server."""

    function: str | None = Field(
        None,
        description="agent function 'package.module:name' (async run_agent(base_url, prompt, "
        "request_kwargs, metadata)); set → agentic rollout, e.g. "
        "miles_core.envs.sandbox_agent:run_agent",
    )
    generate_function: str | None = Field(
        None, description="replace the session-backed generate function (import path)"
    )
    command: list[str] | None = Field(
        None,
        description="a black-box agent program's argv (e.g. [python, examples/blackbox_harness/"
        "agent.py]), run per episode by agent.function miles_core.agents.blackbox:run_command",
    )
    family: str = Field(
        "tiny",
        description="TITO family of the session server: a registered name (tiny, qwen3, mistral, "
        "or one added with miles_core.tito.register_family) or 'package.module:Class'",
    )
    rollout_function: str | None = Field(
        None,
        description="replace the outer agentic rollout function: 'package.module:Class', built "
        "with a RolloutSetup (agents/layers.py: RolloutFunction); default "
        "miles_core.agents.rollout:AgenticRollout",
    )
    max_turns: int = Field(4, gt=0, le=100, description="model calls per episode")
    turn_slack: int | None = Field(
        None,
        ge=0,
        description="a sandbox task's episode may make as many model calls as its scripted "
        "solution has tool calls, plus this many (at most agent.max_turns): 0 asks for a "
        "solution as direct as the script's. Default: agent.max_turns for every episode",
    )
    max_tokens: int = Field(
        96, gt=0, description="new tokens per model call (a tool call must fit: preflight checks)"
    )
    max_session_tokens: int | None = Field(
        None,
        gt=0,
        description="an episode's token budget: its conversation (prompt + every reply and tool "
        "result) at most this many ids; each call's new tokens are capped to what is left, and "
        "a call with nothing left ends the episode, graded (default: the model's context)",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="an episode running longer (wall clock) fails"
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    concurrency: int = Field(32, gt=0, description="episodes in flight")
    routing: Literal["group", "session"] = Field(
        "group",
        description="which episodes share an engine behind the router: `group`, every episode "
        "of a GRPO group (their common prompt is computed once and cached for the siblings); "
        "`session`, each episode by itself (spreads the load finer)",
    )
    reward_function: str | None = Field(
        None,
        description="per-episode reward hook 'pkg.mod:name' (episode: Episode) -> float, applied "
        "after the environment's reward (agents/rewards.py)",
    )
    group_reward_function: str | None = Field(
        None,
        description="per-group reward hook 'pkg.mod:name' (episodes: list[Episode]) -> "
        "list[float], applied last",
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="a reward hook call running longer fails its episodes"
    )
    eval_episodes: int = Field(
        0,
        ge=0,
        description="episodes on fixed evaluation tasks (one each, fixed seeds) before the first "
        "and after the last step, logged as eval/success_rate; 0 = no evaluation",
    )
    eval_every: int = Field(
        0, ge=0, description="also evaluate after every N steps (0 = first and last only)"
    )
    eval_samples: int = Field(
        1,
        ge=1,
        le=16,
        description="episodes per evaluation task, each at its own fixed seed (the first the one "
        "a 1-sample evaluation runs); eval/* average over all of them: k samples, a standard error "
        "about 1/sqrt(k) as wide",
    )

    @model_validator(mode="after")
    def _settings_fit(self) -> AgentConfig:
        if self.function is not None:
            if (self.function == RUN_COMMAND) != bool(self.command):
                raise ValueError(f"agent.command and agent.function: {RUN_COMMAND} go together")
            if self.eval_every and not self.eval_episodes:
                raise ValueError("agent.eval_every needs agent.eval_episodes > 0")
            if self.eval_samples > 1 and not self.eval_episodes:
                raise ValueError("agent.eval_samples needs agent.eval_episodes > 0")
            return self
        unused = [
            name
            for name, value in (
                ("agent.generate_function", self.generate_function),
                ("agent.rollout_function", self.rollout_function),
                ("agent.command", self.command),
                ("agent.reward_function", self.reward_function),
                ("agent.group_reward_function", self.group_reward_function),
                ("agent.eval_episodes", self.eval_episodes),
                ("agent.eval_samples", self.eval_samples > 1),
            )
            if value
        ]
        if unused:
            raise ValueError(f"{', '.join(unused)} needs agent.function (agentic rollout)")
        return self

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        from miles_core.tito import resolve_family

        resolve_family(v)  # ValueError naming the registered families; imports an import path
        return v


class NetworkConfig(_Strict):
    port_range: str | None = Field(
        None,
        description="keep the ports this run binds inside LOW-HIGH, e.g. '30000-30100': engine "
        "servers, the session server, the trainer's torchrun rendezvous and the weight-group "
        "rendezvous (default: any free port; gloo's peer connections stay ephemeral)",
        examples=["30000-30100"],
    )
    api_key: str | None = Field(
        None,
        pattern=r"^[!-~]+$",  # one HTTP header token: printable ASCII, no spaces
        exclude=True,  # a secret: never in MLflow params, checkpoints or Prefect parameters
        repr=False,
        description="the key the run's servers require ('Authorization: Bearer KEY') and its "
        "clients send (default: MILES_API_KEY from the environment, else a random key per run; "
        "prefer the variable, see docs/security.md)",
    )

    @field_validator("port_range")
    @classmethod
    def _valid_range(cls, v: str | None) -> str | None:
        if v is None:
            return None
        from miles_core.proc.ports import PortRange

        return str(PortRange.parse(v))  # ValueError naming the expected form

    @property
    def ports(self):
        """The range as a `miles_core.proc.ports.PortRange` (None: any port)."""
        from miles_core.proc.ports import PortRange

        return PortRange.parse(self.port_range) if self.port_range else None


class RunConfig(_Strict):
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
        from miles_core.engines.registry import engine_routes
        from miles_core.weights import transport_names, transport_route

        r, ws = self.rollout, self.weight_sync
        need, routes = transport_route(ws.transport), engine_routes(r.engine)
        if need not in routes:
            fitting = [n for n in transport_names() if transport_route(n) in routes]
            server = not _in_trainer_process(r.engine)
            hint = "" if server else " (or set rollout.engine: server)"
            raise ValueError(
                f"rollout.engine: {r.engine} needs weight_sync.transport {' | '.join(fitting)}"
                f"{hint}: {ws.transport} loads weights by {need!r}, the engine takes "
                f"{sorted(routes)}"
            )

    @model_validator(mode="after")
    def _batch_invariant(self) -> RunConfig:
        r, t = self.rollout, self.train
        if t.routing_replay or t.check_routing_replay:
            r.return_routed_experts = True  # what the trainer replays or checks against
        if self.agent.function is not None:  # the agent section checks its own settings
            self._check_agentic()
            if self.agent.eval_episodes and self.data.path:
                raise ValueError(
                    "agent.eval_episodes draws fixed tasks from data.task's generator; with "
                    "data.path set there is none: leave agent.eval_episodes at 0"
                )
        if t.advantage_estimator == "grpo" and r.n_samples_per_prompt < 2:
            raise ValueError(
                "rollout.n_samples_per_prompt must be at least 2 for GRPO (advantages are group-relative)"
            )
        samples = r.prompts_per_step * r.n_samples_per_prompt
        if samples % t.global_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step × n_samples_per_prompt ({samples}) must be divisible by "
                f"train.global_batch_size ({t.global_batch_size})"
            )
        if r.num_engines > 1 and _in_trainer_process(r.engine):
            raise ValueError(
                f"rollout.num_engines ({r.num_engines}) starts engine servers behind a router; "
                f"rollout.engine: {r.engine} runs in the trainer's process: set rollout.engine: "
                "server"
            )
        self._check_transport_fits_engine()
        self._check_eval()
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

    def _check_agentic(self) -> None:
        """What an agentic run needs of the other sections; each refusal names the one setting
        that does not fit."""
        r, a = self.rollout, self.agent
        if _in_trainer_process(r.engine):
            raise ValueError(
                "agent.function (agentic rollout) needs an engine server behind the session "
                f"server: rollout.engine: {r.engine} runs in the trainer's process; set "
                "rollout.engine: server"
            )
        if r.mode != "sync" and r.pause_mode == "abort":
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

    def _check_eval(self) -> None:
        e, interval = self.eval, self.checkpoint.interval
        if e.mode == "none":
            return
        if self.agent.function is not None:
            raise ValueError(
                "eval.mode is for task runs; agentic runs evaluate with agent.eval_episodes"
            )
        if e.mode in ("dedicated", "external") and e.every:
            if not interval or e.every % interval:
                raise ValueError(
                    f"eval.mode {e.mode} evaluates saved checkpoints: eval.every ({e.every}) "
                    f"must be a multiple of checkpoint.interval ({interval})"
                )

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


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects dotted.key=value, got {item!r}")
        key, _, raw = item.partition("=")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(
                f"--set {item!r}: the value is not valid YAML ({_yaml_error(e)})"
            ) from e
        out.append((key.strip(), value))
    return out


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error as 'line L, column C: problem' (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Reads a YAML file, applies `dotted.key=value` overrides (values parsed as YAML), validates."""
    tree: dict = {}
    if path is not None:
        with open(path) as f:
            try:
                tree = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {_yaml_error(e)}") from e
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    return RunConfig.model_validate(tree)
