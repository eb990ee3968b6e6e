"""FSDP2 trainer backend: `fully_shard` per decoder layer and at the root, AdamW. One CPU rank
trains the plain module (nothing to shard; the checkpoint, state-dict and weight-transport code
below takes both: `DTensor` parameters or plain ones).

The step loop (sharding, micro-batches, global denominators, metric reduction) is
`miles_core.train.step`, the losses are `miles_core.train.losses`; this file holds what is FSDP2's
own: building and sharding the model on its device, forward to per-token log-probs, backward, the
optimizer step, checkpoints and how the weights leave (the block at the end of the class).

On CUDA, parameters stay fp32 (the optimizer's copy) and FSDP2 computes in bf16 and reduces
gradients in fp32 (`MixedPrecisionPolicy`); on CPU everything is fp32.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from miles_core.device import resolve_device
from miles_core.lora import trainer as lora_trainer
from miles_core.lora.adapter import ADAPTERS_DIR, Adapter, read_adapter_dir
from miles_core.models.family import family_of
from miles_core.precision import qat
from miles_core.precision.plan import QuantPlan
from miles_core.precision.shards import quantized_shards
from miles_core.train import distributed as spmd
from miles_core.train import step as steps
from miles_core.train.backend import BACKENDS
from miles_core.train.batch import TrainBatch
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss_terms import (
    entropy_from_logits,
    gathered_log_probs,
    token_log_probs,
)
from miles_core.train.lr_schedule import build_optimizer
from miles_core.train.optimizer_offload import materialized
from miles_core.train.routing_replay import RouteReplay, RouterReplay
from miles_core.train.shared_prefix import response_logits
from miles_core.train.spmd_calls import SPMDCalls
from miles_core.true_on_policy import ops
from miles_core.true_on_policy.contract import trainer_dtype
from miles_core.weights.source import (
    Placement,
    ShardPlan,
    TensorPlan,
    dim_chunks,
    dtype_name,
    full_tensor_buckets,
)


def has_dropout(config) -> bool:
    """Whether an HF config turns on any dropout (`attention_dropout`, `hidden_dropout`, …)."""
    return any(
        "dropout" in key and isinstance(value, int | float) and value > 0
        for key, value in config.to_dict().items()
    )


@BACKENDS.register("fsdp")
class FSDPBackend(SPMDCalls):
    @staticmethod
    def true_on_policy_refuses(train: dict[str, Any]) -> str | None:
        """Every layout runs the invariant forward: each rank's rows are computed alone."""
        return None

    def __init__(
        self,
        model_dir: str,
        optim: dict[str, Any],
        loss: dict[str, Any] | None = None,
        total_steps: int = 1,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.device = resolve_device(device)
        self.rank, self.world = spmd.init_distributed(self.device)
        self._announce_init(
            model_dir=model_dir,
            optim=optim,
            loss=loss,
            total_steps=total_steps,
            seed=seed,
            device=device,
        )
        if optim.get("threads"):
            torch.set_num_threads(int(optim["threads"]))
        torch.manual_seed(seed)
        self.optim_cfg = optim
        self.loss_cfg = loss or {}
        from transformers import AutoModelForCausalLM  # (importing this module stays cheap)

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.config = model.config
        self.pad_id = int(model.config.pad_token_id or 0)
        self.stochastic_forward = has_dropout(model.config)
        on_cuda = self.device.type == "cuda"
        self.ref_model = None
        # with LoRA the reference is the frozen base itself: the policy with its adapters off
        self.ref_is_base = bool(optim.get("lora")) and self._needs_reference()
        if self._needs_reference() and not self.ref_is_base:
            ref = copy.deepcopy(model).eval().requires_grad_(False)
            # on CUDA the reference computes in bf16 like the FSDP2 policy it is compared with
            self.ref_model = ref.to(self.device, torch.bfloat16) if on_cuda else ref
        # train.qat: linear modules compute with the values the engine serves (precision/qat.py)
        plan = QuantPlan.from_spec(optim.get("qat_precision"), int(model.config.num_hidden_layers))
        self.qat_weights = qat.install(model, plan) if plan is not None else []
        # train.lora: peft's adapters on the target modules, everything else frozen (lora/)
        self.lora = optim.get("lora")
        self.lora_modules = lora_trainer.inject(model, self.lora) if self.lora else []
        self.true_on_policy = bool(optim.get("true_on_policy"))
        invariant = None
        if self.true_on_policy:  # the engines' forward, layer by layer (true_on_policy/)
            family = family_of(model.config.model_type)
            if family is None:
                raise ValueError(f"no model family for {model.config.model_type!r}")
            invariant = family.invariant(model)
            invariant.dtype = trainer_dtype(optim)
            if self.lora:  # the adapters' terms, computed by the invariant kernels
                invariant.lora = lora_trainer.PeftTerms(model)
            invariant.install()
        self.routing = None  # MoE routing replay / its checker (routing_replay.py)
        replay, check = bool(optim.get("routing_replay")), bool(optim.get("check_routing_replay"))
        # the policy's routers only (after the reference copy, which routes by itself)
        if (replay or check) and invariant is not None:  # it routes in its own forward
            self.routing = RouteReplay(len(invariant.moe_mlps()), replay, check)
            invariant.choose = self.routing.choose
        elif replay or check:
            self.routing = RouterReplay(model, replay, check)
        if on_cuda:
            model.to(self.device)
        if self.world > 1 or on_cuda:
            mesh = init_device_mesh(self.device.type, (self.world,))
            mp = {}
            if on_cuda:  # bf16 compute, fp32 gradient reduction; the sharded fp32 params stay
                mp["mp_policy"] = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **mp)
            fully_shard(model, mesh=mesh, **mp)
        # else one CPU rank: nothing to shard or reduce, and FSDP2's per-layer all-gather and
        # reduce-scatter hooks and DTensor optimizer ops cost 20 % of the tiny preset's train
        # step; the plain module runs the same fp32 AdamW over the same parameters, bitwise
        self.model = model
        # optimizer state only for what trains: the model, or each adapter its own (LoRA)
        if self.lora:
            self._optimizers = {
                name: build_optimizer(
                    [p for _, _, p in lora_trainer.adapter_parameters(model, name)],
                    optim,
                    total_steps,
                )
                for name in self.lora["adapters"]
            }
            self._push_names: list[str] | None = None  # push_only: None, every adapter
            self._use_adapter(self.lora["adapters"][0])
        else:
            self.optimizer, self.scheduler = build_optimizer(model.parameters(), optim, total_steps)
        self.micro_batch_size = int(optim["micro_batch_size"])
        # each distinct prompt once per micro-batch (exact, shared_prefix.py); not with dropout,
        # where the group's rows would share one dropout draw over their prompt
        # not with routing replay either: routes are recorded per position of the padded rows
        self.share_prompts = (
            bool(optim.get("share_prompts", True))
            and not self.stochastic_forward
            and self.routing is None
        )

    # ------------------------------------------------------------------ the step loop's calls
    @property
    def dp_rank(self) -> int:  # every rank is a data-parallel rank
        return self.rank

    @property
    def dp_world(self) -> int:
        return self.world

    reports_stats = True

    def forward_backward(self, parts, needs, on_output, train) -> None:
        steps.sequential(self, parts, needs, on_output, train)

    def micro_batch(self, batch: TrainBatch) -> MicroBatch:
        return MicroBatch.build(batch, self.pad_id, self.device, self.share_prompts)

    def forward(self, mb: MicroBatch, needs: LossNeeds) -> TokenOutputs:
        if self.routing is None:
            lp, resp_logits = self._log_probs(self.model, mb)
        else:
            with self.routing.micro_batch(mb):
                lp, resp_logits = self._log_probs(self.model, mb)
        entropy = None
        if needs.entropy != "none":
            logits = resp_logits if needs.entropy == "grad" else resp_logits.detach()
            entropy = entropy_from_logits(logits, mb.temperature)
        gathered = None
        if needs.gather:
            ids = mb.padded.fields[needs.gather]
            gathered = gathered_log_probs(resp_logits, ids, mb.temperature)
        ref = None
        if needs.reference and self.ref_is_base:
            with torch.no_grad(), lora_trainer.adapters_off(self.model):
                ref, _ = self._log_probs(self.model, mb)
        elif needs.reference:
            if self.ref_model is None:
                raise ValueError(
                    "this loss needs reference log-probs, but the backend was built without a "
                    "reference model (its loss settings asked for none: kl_coef 0)"
                )
            with torch.no_grad():
                ref, _ = self._log_probs(self.ref_model, mb)
        return TokenOutputs(lp, entropy, ref, gathered)

    def _log_probs(self, model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        padded = mb.padded
        if mb.prefix is not None:
            resp_logits = response_logits(model, mb.prefix)
        else:
            logits = model(input_ids=padded.input_ids).logits
            idx = padded.targets_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
            resp_logits = logits.gather(1, idx)
        if self.true_on_policy and model is self.model:  # the engines' log-softmax
            lp = ops.tempered_log_softmax(resp_logits, mb.temperature)
            return lp.gather(-1, padded.targets.unsqueeze(-1)).squeeze(-1), resp_logits
        return token_log_probs(resp_logits, padded.targets, mb.temperature), resp_logits

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def set_training(self, training: bool) -> None:
        self.model.train(training)

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optim_cfg["grad_clip"]
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": float(grad_norm), "lr": lr}

    # ------------------------------------------------------------------ checkpoints (all ranks)
    def _save(self, directory: str) -> None:
        path = Path(directory)
        if self.lora:  # the adapters alone, each a peft directory; the base never changes
            adapters = self.adapters()
            if self.rank == 0:
                for adapter in adapters:
                    adapter.save(path / ADAPTERS_DIR / adapter.name)
        else:
            sd = self.full_state_dict()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.config.save_pretrained(str(path))
            if not self.lora:
                save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
            schedulers = self._per_optimizer(lambda _, sched: sched.state_dict())
            with open(path / "trainer_state.json", "w") as f:
                json.dump({"scheduler": schedulers, "world_size": self.world}, f)
        with self._optimizers_materialized():
            osd = self._per_optimizer(lambda opt, _: get_optimizer_state_dict(self.model, opt))
            dcp.save({"optimizer": osd}, checkpoint_id=str(path / "optimizer"))
        if self.world > 1:
            dist.barrier()

    def _per_optimizer(self, fn) -> Any:
        """fn(optimizer, scheduler) of the model's pair, or with LoRA {adapter: fn(...)} over
        each adapter's (a checkpoint holds them so)."""
        items = self._optimizer_items()
        if items[0][0] is None:
            return fn(*items[0][1])
        return {name: fn(*pair) for name, pair in items}

    def _load(self, directory: str) -> None:
        path = Path(directory)
        if self.lora:
            sd = self._adapter_state(path) if self.rank == 0 else {}
        else:
            sd = load_file(str(path / "model.safetensors")) if self.rank == 0 else {}
            if getattr(self.config, "tie_word_embeddings", False) and self.rank == 0:
                sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        set_model_state_dict(
            self.model,
            sd,
            options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=not self.lora
            ),
        )
        if (path / "optimizer").exists():
            with self._optimizers_materialized():
                osd = self._per_optimizer(lambda opt, _: get_optimizer_state_dict(self.model, opt))
                dcp.load({"optimizer": osd}, checkpoint_id=str(path / "optimizer"))
                for name, (opt, _) in self._optimizer_items():
                    set_optimizer_state_dict(self.model, opt, osd if name is None else osd[name])
        state_file = path / "trainer_state.json"
        if state_file.exists():
            with open(state_file) as f:
                saved = json.load(f)["scheduler"]
            for name, (_, sched) in self._optimizer_items():
                sched.load_state_dict(saved if name is None else saved[name])

    @contextlib.contextmanager
    def _optimizers_materialized(self):
        """Every optimizer's state in memory (an offloaded one's brought in) while a
        checkpoint reads or writes it."""
        with contextlib.ExitStack() as stack:
            for _, (opt, _) in self._optimizer_items():
                stack.enter_context(materialized(opt))
            yield

    def _optimizer_items(self) -> list[tuple[str | None, tuple]]:
        if self.lora:
            return list(self._optimizers.items())
        return [(None, (self.optimizer, self.scheduler))]

    # ------------------------------------------------------------------ how weights leave
    # (miles_core.weights.source.TrainerWeights; this block is the weight-sync stream's)
    def _pushed(self) -> list[tuple[str, torch.nn.Parameter]]:
        """What a push sends, by name: every parameter (HF names), or with LoRA only the
        adapters (wire names, lora/names.py); the frozen base never travels."""
        if self.lora:
            names = self.lora["adapters"] if self._push_names is None else self._push_names
            return lora_trainer.pushed_parameters(self.model, names)
        return list(self.model.named_parameters())

    def shard_plan(
        self, dtype: torch.dtype | None = None, precision: dict | None = None
    ) -> ShardPlan:
        """For every parameter, in `send_shards` order: its HF name, full shape, the dtype sent
        and the slice each rank holds. FSDP2 shards along the dim of its `Shard` placement
        (dim 0) in torch.chunk pieces; an unsharded parameter is sent whole by rank 0. With
        `precision` (rollout.precision), quantized weights as their parts (precision/shards.py)."""
        floats = self._float_shard_plan(dtype, precision)
        if precision is None:
            return floats
        return quantized_shards(self._quant_plan(precision), floats)[0]

    def _quant_plan(self, precision: dict) -> QuantPlan:
        return QuantPlan.from_spec(precision, int(self.config.num_hidden_layers))

    def _float_shard_plan(self, dtype: torch.dtype | None, precision: dict | None) -> ShardPlan:
        quant = self._quant_plan(precision) if precision else None
        plan = []
        for name, p in self._pushed():
            shape = list(p.shape)
            quantized = quant is not None and quant.quantized(name, tuple(shape))
            sent = dtype_name(p.dtype if quantized else dtype or p.dtype)
            placement = p.placements[0] if isinstance(p, DTensor) else None
            if isinstance(placement, Shard) and shape:
                pieces = [
                    Placement(r, placement.dim, start, length)
                    for r, (start, length) in enumerate(
                        dim_chunks(shape[placement.dim], self.world)
                    )
                ]
                mine = pieces[self.rank].length
                if p.to_local().shape[placement.dim] != mine:  # the plan is what this rank holds
                    raise RuntimeError(f"{name}: local shard {p.to_local().shape} != plan {mine}")
            else:
                pieces = [Placement(0, 0, 0, shape[0] if shape else 1)]
            plan.append(TensorPlan(name, shape, sent, pieces))
        return plan

    def _send_shards(
        self, engine_ranks: list[int], dtype: torch.dtype | None = None, precision=None
    ) -> int:
        from miles_core.weights.group import Scratch, send_pieces

        scratch = self.__dict__.setdefault("_send_scratch", Scratch())  # kept from push to push
        plan = self._float_shard_plan(dtype, precision)
        pieces = {}  # tensor index in the plan: this rank's slice, sent in one flat buffer
        local = {}  # by name: the same slices (quantized weights' in float32)
        with torch.no_grad():
            params = self._pushed()
            for i, ((name, param), t) in enumerate(zip(params, plan, strict=True)):
                mine = [p for p in t.pieces if p.rank == self.rank and p.length > 0]
                if not mine:
                    continue
                piece = mine[0]
                if isinstance(param, DTensor):
                    held = param.to_local()
                else:
                    held = param.detach().reshape(-1) if not t.shape else param.detach()
                    held = held.narrow(piece.dim, piece.start, piece.length)
                pieces[i] = local[name] = held.detach().to(getattr(torch, t.dtype))
            if precision is not None:  # each rank quantizes its rows (precision/shards.py)
                reduce = None
                if self.world > 1:
                    reduce = lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX)  # noqa: E731
                plan, pieces = quantized_shards(
                    self._quant_plan(precision), plan, local, self.rank, reduce
                )
            pg = self._transfer_group[1]
            return send_pieces(pg, plan, self.rank, pieces, engine_ranks, scratch)

    def _named_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full tensors (rank 0; the other ranks join the gathers)."""
        return full_tensor_buckets(self._pushed(), self.rank, bucket_bytes, dtype)

    # ------------------------------------------------------------------ LoRA adapters
    def use_adapter(self, name: str) -> None:
        """From now on the forward computes with adapter `name` and the optimizer steps it
        (its own AdamW state and LR schedule); the other adapters stay as they are."""
        spmd.announce("use_adapter", (name,))
        self._use_adapter(name)

    def _use_adapter(self, name: str) -> None:
        lora_trainer.activate(self.model, name)
        self.active_adapter = name
        self.optimizer, self.scheduler = self._optimizers[name]

    def push_only(self, names: list[str] | None) -> None:
        """Pushes carry adapters `names` from now on (None: every adapter)."""
        spmd.announce("push_only", (names,))
        self._push_only(names)

    def _push_only(self, names: list[str] | None) -> None:
        self._push_names = None if names is None else list(names)

    def adapter_configs(self) -> dict[str, dict]:
        """Each adapter's peft config (what a disk push writes beside its tensors)."""
        config = lora_trainer.adapter_config(self.lora, self.lora_modules)
        return dict.fromkeys(self.lora["adapters"], config)

    def adapters(self) -> list[Adapter]:
        """Every adapter as rank 0 holds it, full tensors (every rank runs the gathers)."""
        full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
        return [
            lora_trainer.adapter_of(self.model, self.lora, name, self.lora_modules, full)
            for name in self.lora["adapters"]
        ]

    def _adapter_state(self, path: Path) -> dict[str, torch.Tensor]:
        """The adapters of a checkpoint as this model's state-dict entries; every adapter
        and module the run trains must be there."""
        sd = {}
        for name in self.lora["adapters"]:
            adapter = read_adapter_dir(path / ADAPTERS_DIR / name, name)
            if sorted(adapter.weights) != sorted(self.lora_modules):
                raise ValueError(
                    f"{path}: adapter {name} covers {len(adapter.weights)} modules, this run "
                    f"trains {len(self.lora_modules)} (train.lora changed?)"
                )
            for module, (a, b) in adapter.weights.items():
                sd[f"{module}.lora_A.{name}.weight"] = a
                sd[f"{module}.lora_B.{name}.weight"] = b
        return sd

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: every tensor unsharded, HF names, tied duplicates dropped."""
        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if getattr(self.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in sd.items()}
