"""`train.backend: megatron`: the run's HF model trained as a megatron-core `GPTModel` with tensor,
pipeline and data parallelism, and an MoE model's experts split over expert-parallel ranks
(`train.parallel`, `layout.py`); routing replay through Megatron's router hook
(`routing_replay.py`).

The step loop, the losses and the data-parallel split are the shared ones
(`miles_core.train.step`); this file holds what is Megatron's own: the model built per pipeline
stage (`model.py`), its weights converted from and to HF (`convert.py`), the forward to
per-token log-probs (the vocabulary-parallel logits of the response positions gathered over the
tensor-parallel group, the vocabulary padding dropped), the schedule of micro-batches through the
stages (`pipeline.py`), gradients in Megatron's `DistributedDataParallel` buffers (reduced over
data-parallel ranks, tied embeddings reduced between the first and last stage), the optimizer
step, checkpoints (`checkpoint.py`) and how the weights leave (the block at the end of the class).

On CPU: gloo, the CPU shim (`cpu.py`), fp32, torch's AdamW on Megatron's gradient buffers. CUDA
is refused before start for now (`check_model`, `CUDA_NOT_BUILT`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from miles_core.device import resolve_device
from miles_core.train import distributed as spmd
from miles_core.train.backends.megatron import convert
from miles_core.train.backends.megatron.layout import (
    Layout,
    check_buildable,
    check_model_divides,
    resolve_layout,
)
from miles_core.train.batch import TrainBatch
from miles_core.train.forward import LossNeeds, MicroBatch, TokenOutputs
from miles_core.train.loss_terms import (
    entropy_from_logits,
    gathered_log_probs,
    token_log_probs,
)
from miles_core.train.lr_schedule import build_optimizer
from miles_core.train.optimizer_offload import materialized
from miles_core.train.spmd_calls import SPMDCalls
from miles_core.true_on_policy import ops
from miles_core.true_on_policy.contract import trainer_dtype
from miles_core.weights.source import Placement, ShardPlan, TensorPlan, dtype_name

MEGATRON_DIR = "megatron"  # the distributed checkpoint beside the HF export
CUDA_NOT_BUILT = (
    "train.backend megatron runs on CPU in this version (its CUDA path, with nccl, bf16 and "
    "Megatron's distributed optimizer, is not built yet): set train.device: cpu"
)


def _groups_alive() -> bool:
    """Megatron's groups belong to the current default group (one destroyed and made anew, a
    later run in the same process, leaves them stale)."""
    from megatron.core import parallel_state as ps

    try:
        dist.get_rank(ps.get_model_parallel_group())
    except (ValueError, RuntimeError):
        return False
    return True


def init_model_parallel(layout: Layout) -> None:
    """Megatron's process groups for `layout` (kept if they exist for the same layout)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == layout.tp
            and ps.get_pipeline_model_parallel_world_size() == layout.pp
            and ps.get_context_parallel_world_size() == layout.cp
            and ps.get_expert_model_parallel_world_size() == layout.ep
        )
        if same and _groups_alive():
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,  # experts are never split over tensor-parallel ranks
    )


class MegatronBackend(SPMDCalls):
    model_parallel = True  # train.parallel: tensor, pipeline and expert parallel layouts
    # why train.lora is refused before a run starts
    lora_refused = (
        "megatron-core ships no LoRA layers (adapters live in Megatron-Bridge's PEFT, which is "
        "not part of this stack); train adapters with train.backend: fsdp"
    )

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
        if self.device.type != "cpu":
            raise ValueError(CUDA_NOT_BUILT)
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
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        from miles_core.train.backends.megatron.architecture import check_architecture
        from miles_core.train.backends.megatron.cpu import apply_cpu_shim
        from miles_core.train.backends.megatron.model import build_gpt
        from miles_core.train.backends.megatron.pipeline import Stage

        self.hf_config = AutoConfig.from_pretrained(model_dir)
        hf = self.hf_config.to_dict()
        check_architecture(hf)
        self.shapes = convert.Shapes.of(hf)
        self.layout = resolve_layout(optim.get("parallel"), self.world)
        check_buildable(self.layout)
        check_model_divides(self.layout, hf)
        apply_cpu_shim()
        init_model_parallel(self.layout)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_world = ps.get_data_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.shapes.experts else 0
        self.edp_rank = ps.get_expert_data_parallel_rank() if self.shapes.experts else 0
        self.stage = Stage()
        self.reports_stats = self.stage.last and self.tp_rank == 0
        self.layer_offset = self.pp_rank * (self.shapes.layers // self.layout.pp)
        self.experts_here = self.shapes.experts // self.layout.ep  # routed experts per rank
        self.expert_offset = self.ep_rank * self.experts_here
        self.holders, self.expert_holders = self._holders()
        torch.manual_seed(seed)
        self.optim_cfg = optim
        self.loss_cfg = loss or {}
        self.pad_id = int(self.hf_config.pad_token_id or 0)
        self.stochastic_forward = bool(hf.get("attention_dropout"))
        self.micro_batch_size = int(optim["micro_batch_size"])
        self.dtype = torch.float32

        # every rank reads the HF weights and keeps its stage's tensor-parallel shards (and
        # its expert-parallel share of the experts)
        full = convert.hf_to_megatron(self._hf_file(Path(model_dir)), self.shapes)
        self.ref_model = None
        if self._needs_reference():  # built like the policy (Megatron modules hold process
            ref = build_gpt(hf, self.layout, self.dtype)  # groups: they cannot be deep-copied)
            self._set_full(ref, full)
            self.ref_model = ref.eval().requires_grad_(False)
        replay, check = bool(optim.get("routing_replay")), bool(optim.get("check_routing_replay"))
        model = build_gpt(hf, self.layout, self.dtype, replay_hook=replay or check)
        self._set_full(model, full)
        del full
        if replay or check:  # the policy's routers (the reference's route by themselves)
            from miles_core.train.backends.megatron.routing_replay import MegatronRouterReplay

            self.routing = MegatronRouterReplay(model, self.shapes, replay, check)
        if self.stage.first and self.hf_config.pad_token_id is not None:
            model.embedding.word_embeddings.register_forward_hook(self._no_pad_gradient)
        self.true_on_policy = bool(optim.get("true_on_policy"))
        if self.true_on_policy:  # the engines' forward (true_on_policy/), over these tensors
            invariant = check_architecture(hf).megatron_invariant(model, hf)
            invariant.dtype = trainer_dtype(optim)
            invariant.install()
        self.model = model
        self.ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False
            ),
            module=model,
        )
        self.params = [p for p in self.ddp.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, optim, total_steps)

    @staticmethod
    def true_on_policy_refuses(train: dict[str, Any]) -> str | None:
        """The invariant forward holds a layer's tensors whole: one tensor-parallel, pipeline
        and context-parallel rank (data parallel ranks each compute their own rows)."""
        p = train.get("parallel") or {}
        split = {k: p.get(k, 1) for k in ("tp", "pp", "cp") if p.get(k, 1) != 1}
        if split:
            sizes = ", ".join(f"train.parallel.{k}={v}" for k, v in split.items())
            return f"{sizes}: the invariant forward runs at tp = pp = cp = 1"
        return None

    @staticmethod
    def check_model(settings: dict[str, Any], hf: dict[str, Any], where: str) -> None:
        """Before anything starts: the converter knows the architecture, the invariant forward
        computes it when `train.true_on_policy` asks, and the layout of `settings`
        (train.parallel, train.world_size) divides the model (preflight)."""
        from miles_core.train.backends.megatron.architecture import check_architecture

        family = check_architecture(hf, where)
        if settings.get("true_on_policy"):
            reason = family.megatron_invariant_refuses(hf)
            if reason is not None:
                raise ValueError(
                    f"train.true_on_policy with train.backend megatron cannot run {where}: {reason}"
                )
        if resolve_device(settings.get("device") or "auto").type != "cpu":
            raise ValueError(CUDA_NOT_BUILT)
        layout = resolve_layout(settings.get("parallel"), int(settings.get("world_size", 1)))
        check_buildable(layout)
        check_model_divides(layout, hf)

    def _no_pad_gradient(self, module, args, out: torch.Tensor) -> torch.Tensor:
        """HF's embedding has `padding_idx`: a pad token's lookup sends no gradient to its row
        (a zero row under RMSNorm would get a huge one). Megatron's has none: the same here."""
        pad = (args[0] == self.pad_id).unsqueeze(-1)
        return torch.where(pad, out.detach(), out) if bool(pad.any()) else out

    def _holders(self) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
        """The ranks that send weights: (pipeline stage, tensor-parallel rank) → the global
        rank of data-parallel replica 0 holding it; (stage, expert-parallel rank) → the rank of
        expert-data-parallel replica 0 holding those experts."""
        me = (self.pp_rank, self.tp_rank, self.dp_rank, self.ep_rank, self.edp_rank, self.rank)
        everyone: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(everyone, me)
        else:
            everyone = [me]
        dense = {(pp, tp): r for pp, tp, dp, _, _, r in everyone if dp == 0}
        experts = {(pp, ep): r for pp, tp, _, ep, edp, r in everyone if edp == 0 and tp == 0}
        return dense, experts

    # ------------------------------------------------------------------ HF weights in
    def _stage_names(self, model) -> dict[str, str]:
        """This stage's weights (local names: parameters, and a router's correction bias,
        a buffer) → their global names (layer and expert offsets added)."""
        names = [n for n, _ in model.named_parameters()]
        names += [n for n, _ in model.named_buffers() if _is_buffer(n)]
        return {n: convert.global_name(n, self.layer_offset, self.expert_offset) for n in names}

    @staticmethod
    def _tensor(model, local: str) -> torch.Tensor:
        """A weight of `model` by local name: a parameter, or the correction-bias buffer."""
        if _is_buffer(local):
            return model.get_buffer(local)
        return model.get_parameter(local)

    def _set_full(self, model, full: dict[str, torch.Tensor]) -> None:
        s, tp = self.shapes, self.layout.tp
        with torch.no_grad():
            for local, name in self._stage_names(model).items():
                if name == "output_layer.weight" and s.tied:  # the last stage's copy
                    source = full["embedding.word_embeddings.weight"]
                else:
                    source = full[name]
                shard = convert.tp_shard(name, source, tp, self.tp_rank, s)
                param = self._tensor(model, local)
                if param.shape != shard.shape:
                    raise ValueError(f"{name}: shard {tuple(shard.shape)} != {tuple(param.shape)}")
                param.copy_(shard)

    # ------------------------------------------------------------------ the step loop's calls
    def micro_batch(self, batch: TrainBatch, width: int = 0) -> MicroBatch:
        return MicroBatch.build(batch, self.pad_id, self.device, width=width)

    def _micro_batches(self, parts: list[TrainBatch]) -> list[MicroBatch]:
        """The micro-batches of `parts`; under expert parallelism each padded to the widest of
        the expert-parallel group's same micro-batch (the ranks exchange their tokens in every
        MoE layer, in equal shapes)."""
        widths = [0] * len(parts)
        if self.layout.ep > 1 and parts:
            from megatron.core import parallel_state as ps

            most = torch.tensor([max(len(t) for t in p.tokens) for p in parts])
            dist.all_reduce(most, dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
            widths = most.tolist()
        return [self.micro_batch(p, w) for p, w in zip(parts, widths, strict=True)]

    def _run(self, model, mb: MicroBatch) -> torch.Tensor:
        """This stage's forward of one micro-batch: hidden states, or (last stage) the
        vocabulary-parallel logits [B, S, V/tp]. The policy's routers replay (or are checked
        against) the micro-batch's recorded routes when the run asks."""
        ids = mb.padded.input_ids
        n = ids.shape[1]
        positions = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)[None, None]
        if self.routing is None or model is self.ref_model:
            return model(input_ids=ids, position_ids=positions, attention_mask=causal)
        with self.routing.micro_batch(mb):
            return model(input_ids=ids, position_ids=positions, attention_mask=causal)

    def _outputs(
        self, logits: torch.Tensor, mb: MicroBatch, needs: LossNeeds, ref, policy: bool = True
    ) -> TokenOutputs:
        """Per-token log-probs (and entropy, and the log-probs of LossNeeds.gather's ids) of the
        response positions: their vocabulary shards gathered over the tensor-parallel group
        (backward: each rank its shard), padding dropped."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        padded = mb.padded
        idx = padded.targets_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        resp = logits.gather(1, idx)
        if self.layout.tp > 1:
            resp = gather_from_tensor_model_parallel_region(resp)
        resp = resp[..., : self.shapes.vocab]
        if policy and self.true_on_policy:  # the engines' log-softmax
            lp = ops.tempered_log_softmax(resp, mb.temperature)
            lp = lp.gather(-1, padded.targets.unsqueeze(-1)).squeeze(-1)
        else:
            lp = token_log_probs(resp, padded.targets, mb.temperature)
        entropy = None
        if needs.entropy != "none":
            entropy = entropy_from_logits(
                resp if needs.entropy == "grad" else resp.detach(), mb.temperature
            )
        gathered = None
        if needs.gather:
            gathered = gathered_log_probs(resp, padded.fields[needs.gather], mb.temperature)
        return TokenOutputs(lp, entropy, ref, gathered)

    def forward_backward(self, parts, needs: LossNeeds, on_output, train: bool) -> None:
        from miles_core.train.backends.megatron.pipeline import run_pipeline

        mbs = self._micro_batches(parts)
        refs: list[torch.Tensor | None] = [None] * len(mbs)
        if needs.reference:
            if self.ref_model is None:
                raise ValueError(
                    "this loss needs reference log-probs, but the backend was built without a "
                    "reference model (its loss settings asked for none: kl_coef 0)"
                )

            def keep_ref(i: int, logits: torch.Tensor) -> None:
                refs[i] = self._outputs(logits, mbs[i], LossNeeds(), None, policy=False).log_probs

            with torch.no_grad():
                run_pipeline(
                    self.stage,
                    self.ref_model,
                    lambda i: self._run(self.ref_model, mbs[i]),
                    keep_ref,
                    len(mbs),
                    False,
                    self.dtype,
                    self.device,
                )

        def last(i: int, logits: torch.Tensor):
            loss = on_output(mbs[i], self._outputs(logits, mbs[i], needs, refs[i]))
            # the step loop scales by dp_world for an averaging reduction; Megatron's sums
            return None if loss is None else loss / self.dp_world

        if self.layout.pp == 1:  # no stages to pass between: the plain loop
            for i, mb in enumerate(mbs):
                loss = last(i, self._run(self.ddp, mb))
                if train and loss is not None:
                    loss.backward()
            return
        run_pipeline(
            self.stage,
            self.model,
            lambda i: self._run(self.ddp, mbs[i]),
            last,
            len(mbs),
            train,
            self.dtype,
            self.device,
        )

    def set_training(self, training: bool) -> None:
        self.ddp.train(training)

    def optimizer_step(self) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])  # data-parallel sum; tied embedding between stages
        for p in self.params:
            p.grad = p.main_grad
        grad_norm = self._grad_norm()
        coef = min(self.optim_cfg["grad_clip"] / (grad_norm + 1e-6), 1.0)
        with torch.no_grad():
            for p in self.params:
                p.grad.mul_(coef)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.ddp.zero_grad_buffer()
        for p in self.params:
            p.grad = None
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def _grad_norm(self) -> float:
        """The global gradient norm: each parameter counted once (tensor-parallel replicas of
        norms, and a last stage's tied copy of the embedding, left out), summed over the
        model-parallel group; routed experts summed over the expert-parallel ranks that hold
        them (and the stages)."""
        from megatron.core import parallel_state as ps

        dense = torch.zeros((), dtype=torch.float64)
        experts = torch.zeros((), dtype=torch.float64)
        for local, name in self._stage_names(self.model).items():
            if name == "output_layer.weight" and self.shapes.tied:
                continue  # the embedding's copy, counted on the first stage
            if _is_buffer(name):
                continue  # no gradient
            if convert.tp_dim(name) is None and self.tp_rank != 0:
                continue  # replicated: every tensor-parallel rank holds the same gradient
            grad = self.model.get_parameter(local).grad.double().pow(2).sum()
            if convert.expert_of(name) is None:
                dense += grad
            else:
                experts += grad
        if self.layout.tp * self.layout.pp > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
        if self.shapes.experts and self.layout.ep * self.layout.pp > 1:
            dist.all_reduce(experts, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + experts).sqrt())

    def take_stats(self) -> dict[str, float]:
        """The routing checker's counts of this rank's routers (one tensor-parallel rank per
        stage and replica: the others count the same tokens)."""
        counts = super().take_stats()
        return counts if self.tp_rank == 0 else {}

    # ------------------------------------------------------------------ checkpoints (all ranks)
    def _save(self, directory: str) -> None:
        from miles_core.train.backends.megatron import checkpoint

        path = Path(directory)
        sd = self.full_state_dict()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.hf_config.save_pretrained(str(path))
            save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
            with open(path / "trainer_state.json", "w") as f:
                state = {
                    "scheduler": self.scheduler.state_dict(),
                    "world_size": self.world,
                    "backend": "megatron",
                    "parallel": self.layout.__dict__,
                }
                json.dump(state, f)
        if self.world > 1:
            dist.barrier()
        with materialized(self.optimizer):
            checkpoint.save(self, path / MEGATRON_DIR)

    def _load(self, directory: str) -> None:
        from miles_core.train.backends.megatron import checkpoint

        path = Path(directory)
        if (path / MEGATRON_DIR).exists():
            with materialized(self.optimizer):
                checkpoint.load(self, path / MEGATRON_DIR)
        else:  # an HF directory (e.g. FSDP's checkpoint): the weights, a fresh optimizer
            self._set_full(self.model, convert.hf_to_megatron(self._hf_file(path), self.shapes))
        state_file = path / "trainer_state.json"
        if state_file.exists():
            with open(state_file) as f:
                self.scheduler.load_state_dict(json.load(f)["scheduler"])

    def _hf_file(self, path: Path) -> dict[str, torch.Tensor]:
        return load_file(str(path / "model.safetensors"))

    # ------------------------------------------------------------------ how weights leave
    # (miles_core.weights.source.TrainerWeights)
    def _global_order(self, buffers: bool = False) -> list[str]:
        """Every Megatron parameter of the whole model (global names), in the order weights
        leave; with `buffers`, the routers' correction biases too (fixed: checkpoints hold
        them, pushes do not, as for FSDP2's HF modules)."""
        s = self.shapes
        names = ["embedding.word_embeddings.weight"]
        for i in range(s.layers):
            p = f"decoder.layers.{i}."
            names += [
                p + "input_layernorm.weight",
                p + convert.QKV,
                p + "self_attention.q_layernorm.weight",
                p + "self_attention.k_layernorm.weight",
                p + "self_attention.linear_proj.weight",
                p + "pre_mlp_layernorm.weight",
            ]
            if i in s.moe_layers:
                names += convert.moe_layer_names(i, s)
            else:
                names += [p + convert.FC1, p + "mlp.linear_fc2.weight"]
        names.append("decoder.final_layernorm.weight")
        if not s.tied:
            names.append("output_layer.weight")
        return names if buffers else [n for n in names if not _is_buffer(n)]

    def _stage_of(self, name: str) -> int:
        m = convert._MC_LAYER.fullmatch(name)
        per = self.shapes.layers // self.layout.pp
        if m:
            return int(m.group(1)) // per
        return 0 if name.startswith("embedding.") else self.layout.pp - 1

    def _full_shape(self, name: str) -> list[int]:
        return convert.full_shape(name, self.shapes, self.layout.tp)

    def _holder(self, name: str, tp_rank: int = 0) -> int:
        """The rank that sends Megatron tensor `name` (global): for a routed expert, the
        expert-parallel rank holding it; otherwise tensor-parallel rank `tp_rank` of data-
        parallel replica 0, on the tensor's stage."""
        stage, e = self._stage_of(name), convert.expert_of(name)
        if e is not None:
            return self.expert_holders[(stage, e // self.experts_here)]
        return self.holders[(stage, tp_rank)]

    def _gather_full(self, name: str) -> torch.Tensor | None:
        """The full Megatron tensor `name` on global rank 0 (None elsewhere): its stage's
        replica-0 tensor-parallel ranks gather it, that stage's rank 0 sends it to rank 0 (a
        routed expert: the expert-parallel rank holding it sends it whole)."""
        from megatron.core import parallel_state as ps

        source = self._holder(name)
        if convert.expert_of(name) is not None:  # one rank holds it whole (no tp split)
            full = None
            if self.rank == source:
                local = convert.stage_name(name, self.layer_offset, self.expert_offset)
                full = self._tensor(self.model, local).detach()
            if source == 0:
                return full
        else:
            if self.dp_rank != 0:
                return None
            full = None
            if self._stage_of(name) == self.pp_rank:
                local = self._tensor(self.model, convert.stage_name(name, self.layer_offset))
                local = local.detach()
                if self.layout.tp > 1:
                    parts = [torch.empty_like(local) for _ in range(self.layout.tp)]
                    dist.all_gather(
                        parts, local.contiguous(), group=ps.get_tensor_model_parallel_group()
                    )
                    full = convert.tp_unshard(name, parts, self.shapes)
                else:
                    full = local
            if source == 0:
                return full if self.rank == 0 else None
        if self.rank == source:
            dist.send(full.contiguous(), 0)
        elif self.rank == 0:
            full = torch.empty(self._full_shape(name), dtype=self.dtype, device=self.device)
            dist.recv(full, source)
            return full
        return None

    def _named_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None, buffers: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full HF tensors (rank 0). Every rank runs the same gathers and sends, to
        the end even if rank 0's consumer stops early (the others never wait on one it skipped).
        An HF fused expert tensor leaves once all its experts' rows have arrived."""
        names = self._global_order(buffers)
        done = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        rows: dict[str, list[torch.Tensor]] = {}  # fused HF expert tensor → its rows so far
        try:
            with torch.no_grad():
                for name in names:
                    full = self._gather_full(name)
                    done += 1
                    if self.rank != 0:
                        continue
                    expert = convert.expert_of(name) is not None
                    for hf_name, t in convert.to_hf(name, full, self.shapes):
                        if expert:
                            rows.setdefault(hf_name, []).append(t)
                            if len(rows[hf_name]) < self.shapes.experts:
                                continue
                            t = torch.cat(rows.pop(hf_name))
                        t = t.to(dtype) if dtype is not None else t.clone()
                        bucket.append((hf_name, t))
                        size += t.numel() * t.element_size()
                    if size >= bucket_bytes:
                        yield bucket
                        bucket, size = [], 0
            if bucket:
                yield bucket
        finally:
            with torch.no_grad():
                for name in names[done:]:
                    self._gather_full(name)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: every HF tensor, unsharded (tied: no lm_head). Every rank joins."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self._named_weights(64 << 20, buffers=True):
            out.update((n, t.contiguous()) for n, t in bucket)
        return out

    def shard_plan(
        self, dtype: torch.dtype | None = None, precision: dict | None = None
    ) -> ShardPlan:
        """Every HF tensor, in `send_shards` order: the slice each holding rank sends (data-
        parallel replica 0 of each stage and tensor-parallel rank; replicated norms from
        tensor-parallel rank 0)."""
        _refuse_quantized_shards(precision)
        s, tp = self.shapes, self.layout.tp
        sent = dtype_name(dtype or self.dtype)
        shapes: dict[str, list[int]] = {}  # HF tensors in order, with their pieces
        pieces: dict[str, list[Placement]] = {}
        for name in self._global_order():
            e = convert.expert_of(name)
            for hf_name, t in convert.to_hf(name, self._empty_full(name), s):
                shapes.setdefault(
                    hf_name, [s.experts, *t.shape[1:]] if e is not None else [*t.shape]
                )
                pieces.setdefault(hf_name, [])
            if e is not None:  # an expert-parallel rank sends its experts' rows as one piece
                if e % self.experts_here == 0:
                    for hf_name in convert.hf_names(name, s):
                        place = Placement(self._holder(name), 0, e, self.experts_here)
                        pieces[hf_name].append(place)
                continue
            ranks = range(tp) if convert.tp_dim(name) is not None else range(1)
            for r in ranks:
                for hf_name, dim, start, length in convert.hf_pieces(name, s, tp, r):
                    if length < 0:
                        length = shapes[hf_name][0]
                    pieces[hf_name].append(Placement(self._holder(name, r), dim, start, length))
        return [TensorPlan(n, shape, sent, pieces[n]) for n, shape in shapes.items()]

    def _empty_full(self, name: str) -> torch.Tensor:
        return torch.empty(self._full_shape(name), dtype=torch.float32, device="meta")

    def _send_shards(
        self, engine_ranks: list[int], dtype: torch.dtype | None = None, precision=None
    ) -> int:
        """Every holding rank sends its tensor-parallel shards, converted to HF slices (no
        gather); the engine assembles them from `shard_plan`."""
        _refuse_quantized_shards(precision)
        from miles_core.weights.group import Scratch, send_pieces

        scratch = self.__dict__.setdefault("_send_scratch", Scratch())
        plan = self.shard_plan(dtype)
        index = {t.name: i for i, t in enumerate(plan)}
        groups = self.shapes.groups // self.layout.tp
        parts: dict[int, list[torch.Tensor]] = {}  # an expert-parallel rank: its experts' rows
        with torch.no_grad():
            for local, name in self._stage_names(self.model).items():
                tp = self.tp_rank if convert.tp_dim(name) is not None else 0
                if self._holder(name, tp) != self.rank:
                    continue  # another replica sends it (a replicated norm: tp rank 0)
                if name == "output_layer.weight" and self.shapes.tied or _is_buffer(name):
                    continue
                param = self._tensor(self.model, local).detach()
                for hf_name, t in convert.to_hf(name, param, self.shapes, groups=groups):
                    parts.setdefault(index[hf_name], []).append(t)
            pieces: dict[int, torch.Tensor] = {}
            for i, rows in parts.items():
                t = torch.cat(rows) if len(rows) > 1 else rows[0]
                [mine] = [p for p in plan[i].pieces if p.rank == self.rank]
                t = t.narrow(0, 0, mine.length) if mine.dim == 0 else t
                pieces[i] = t.to(dtype or t.dtype).contiguous()
            return send_pieces(
                self._transfer_group[1], plan, self.rank, pieces, engine_ranks, scratch
            )


def _is_buffer(name: str) -> bool:
    """A router's correction bias: a buffer of the model, not a parameter."""
    return name.endswith("router.expert_bias")


def _refuse_quantized_shards(precision: dict | None) -> None:
    if precision:
        raise ValueError(
            "rollout.precision with weight_sync.transport p2p needs train.backend: fsdp (tensor-"
            "parallel shards split the blocks a format scales over)"
        )
