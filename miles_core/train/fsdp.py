"""FSDP2 trainer backend: `fully_shard` per decoder layer and at the root, AdamW, GRPO/PPO or SFT loss.

The global batch is split evenly over the ranks and into micro-batches; losses are masked sums
divided by the *global* token (or sequence) count, times the world size because FSDP2 averages
gradients over ranks, so N ranks compute the same update as one.
"""

from __future__ import annotations

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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from miles_core.train import distributed as spmd
from miles_core.train.batch import PaddedBatch, TrainBatch
from miles_core.train.corrections import correction_weights
from miles_core.train.losses import (
    aggregate,
    entropy_from_logits,
    k3_kl,
    ppo_clip_loss,
    token_log_probs,
)
from miles_core.train.lr_schedule import build_scheduler


class FSDPBackend:
    def __init__(
        self,
        model_dir: str,
        optim: dict[str, Any],
        loss: dict[str, Any] | None = None,
        total_steps: int = 1,
        seed: int = 0,
    ):
        self.rank, self.world = spmd.init_distributed()
        spmd.announce(
            "init",
            dict(model_dir=model_dir, optim=optim, loss=loss, total_steps=total_steps, seed=seed),
        )
        if optim.get("threads"):
            torch.set_num_threads(int(optim["threads"]))
        torch.manual_seed(seed)
        self.optim_cfg = optim
        self.loss_cfg = loss or {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.config = model.config
        self.pad_id = int(model.config.pad_token_id or 0)
        self.ref_model = None
        if self.loss_cfg.get("kl_coef", 0.0) > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=optim["lr"],
            betas=(optim["adam_beta1"], optim["adam_beta2"]),
            weight_decay=optim["weight_decay"],
            eps=1e-8,
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            optim["lr"],
            optim["min_lr"],
            optim["lr_warmup_steps"],
            total_steps,
            optim["lr_decay_style"],
        )
        self.micro_batch_size = int(optim["micro_batch_size"])

    # ------------------------------------------------------------------ public calls (rank 0)
    def compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        spmd.announce("compute_log_probs", (batch,))
        return self._compute_log_probs(batch)

    def train_step(self, batch: TrainBatch, loss: str = "policy") -> dict[str, float]:
        spmd.announce("train_step", (batch, loss))
        return self._train_step(batch, loss)

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        spmd.announce("named_weights", (bucket_bytes, dtype))
        return self._named_weights(bucket_bytes, dtype)

    def param_specs(self, dtype: torch.dtype | None = None) -> list[tuple[str, list[int], str]]:
        """(HF name, full shape, dtype sent) of every parameter, in the order `send_shards`
        sends them."""
        return [
            (n, list(p.shape), str(dtype or p.dtype).removeprefix("torch."))
            for n, p in self.model.named_parameters()
        ]

    def join_group(self, group: dict) -> None:
        """Every rank joins the weight-transfer group {host, port, world} as its own rank."""
        spmd.announce("join_group", (group,))
        self._join_group(group)

    def send_shards(self, engine_ranks: list[int], dtype: torch.dtype | None = None) -> int:
        """p2p push: every rank sends its own dim-0 shard of each parameter (cast to `dtype` if
        given) to each engine rank of the joined group (no gather). Returns the bytes this rank
        sent."""
        spmd.announce("send_shards", (engine_ranks, dtype))
        return self._send_shards(engine_ranks, dtype)

    def save(self, directory: str) -> None:
        spmd.announce("save", (directory,))
        self._save(directory)

    def load(self, directory: str) -> None:
        spmd.announce("load", (directory,))
        self._load(directory)

    def close(self) -> None:
        spmd.announce("close", None)

    # ------------------------------------------------------------------ implementations (all ranks)
    def _local(self, batch: TrainBatch) -> TrainBatch:
        n = len(batch)
        if n % self.world:
            raise ValueError(f"batch of {n} samples does not split over {self.world} ranks")
        per = n // self.world
        return batch.slice(self.rank * per, (self.rank + 1) * per)

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        for start in range(0, len(batch), self.micro_batch_size):
            yield batch.slice(start, start + self.micro_batch_size)

    def _forward(
        self, model, padded: PaddedBatch, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=padded.input_ids).logits
        idx = padded.targets_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        resp_logits = logits.gather(1, idx)
        return token_log_probs(resp_logits, padded.targets, temperature), resp_logits

    def _compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        local = self._local(batch)
        rows: list[list[float]] = []
        with torch.no_grad():
            for mb in self._micro_batches(local):
                padded = PaddedBatch.build(mb, self.pad_id)
                lp, _ = self._forward(self.model, padded, batch.temperature)
                rows.extend(padded.unpad(lp, mb.response_lengths))
        return self._gather_rows(rows)

    def _gather_rows(self, rows: list[list[float]]) -> list[list[float]]:
        if self.world == 1:
            return rows
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, rows)
        return [r for part in parts for r in part]

    def _train_step(self, batch: TrainBatch, loss: str) -> dict[str, float]:
        self.model.train()
        local = self._local(batch)
        agg = self.loss_cfg.get("loss_agg", "token_mean") if loss == "policy" else "token_mean"
        global_tokens = float(sum(sum(m) for m in batch.loss_masks))
        denom = max(global_tokens, 1.0) if agg == "token_mean" else float(len(batch))
        if agg == "rollout_mean_token_mean":  # totals over the global batch, then shard
            batch, rollouts = batch.with_rollout_tokens()
            local, denom = self._local(batch), float(rollouts)
        sums: dict[str, float] = {}
        for mb in self._micro_batches(local):
            padded = PaddedBatch.build(mb, self.pad_id)
            lp, resp_logits = self._forward(self.model, padded, batch.temperature)
            if loss == "sft":
                mb_loss, stats = self._sft_loss(lp, padded, denom)
            else:
                mb_loss, stats = self._policy_loss(lp, resp_logits, padded, mb, agg, denom)
            (mb_loss * self.world).backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optim_cfg["grad_clip"]
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.model.eval()
        metrics = self._reduce(sums, global_tokens)
        metrics.update({"grad_norm": float(grad_norm), "lr": lr})
        return metrics

    def _sft_loss(self, lp: torch.Tensor, padded: PaddedBatch, denom: float):
        nll = aggregate(-lp, padded.mask, "token_mean", denom)
        return nll, {"loss": float(nll.detach())}

    def _policy_loss(
        self, lp, resp_logits, padded: PaddedBatch, mb: TrainBatch, agg: str, denom: float
    ):
        if mb.old_log_probs is None or mb.advantages is None:
            raise ValueError("policy loss needs old_log_probs (compute_log_probs) and advantages")
        mask = padded.mask
        rows = None if mb.rollout_tokens is None else torch.tensor(mb.rollout_tokens)
        old = padded.per_token(mb.old_log_probs)
        adv = torch.tensor(mb.advantages, dtype=torch.float32).unsqueeze(1).expand_as(mask)
        cfg = self.loss_cfg
        eps_high = cfg.get("eps_clip_high") or cfg["eps_clip"]
        pg, clipped, approx_kl = ppo_clip_loss(lp, old, adv, cfg["eps_clip"], eps_high)
        off = dict(cfg.get("off_policy") or {})
        correction = None
        if off.get("mode", "none") != "none":
            if mb.rollout_log_probs is None:
                raise ValueError(
                    "train.off_policy needs the engine's log-probs (samples without "
                    "rollout_log_probs)"
                )
            rollout = padded.per_token(mb.rollout_log_probs)
            correction = correction_weights(old, rollout, mask, **off)
            pg = pg * correction.weights  # the numerator only: `denom` keeps every token
        pg_loss = aggregate(pg, mask, agg, denom, rows)
        total = pg_loss
        logits_for_entropy = resp_logits if cfg.get("entropy_coef") else resp_logits.detach()
        entropy = entropy_from_logits(logits_for_entropy, mb.temperature)
        if cfg.get("entropy_coef"):
            total = total - cfg["entropy_coef"] * aggregate(entropy, mask, agg, denom, rows)
        stats = {
            "pg_loss": float(pg_loss.detach()),
            "_pg_clipfrac": float((clipped * mask).sum()),
            "_ppo_kl": float((approx_kl.detach() * mask).sum()),
            "_entropy": float((entropy.detach() * mask).sum()),
        }
        if self.ref_model is not None:
            with torch.no_grad():
                ref_lp, _ = self._forward(self.ref_model, padded, mb.temperature)
            kl = k3_kl(lp, ref_lp)
            kl_loss = aggregate(kl, mask, agg, denom, rows)
            total = total + cfg["kl_coef"] * kl_loss
            stats["kl_loss"] = float(kl_loss.detach())
        if mb.rollout_log_probs is not None:
            rollout = padded.per_token(mb.rollout_log_probs)
            diff = old - rollout
            stats["_train_rollout_logprob_abs_diff"] = float((diff.abs() * mask).sum())
            stats["_train_rollout_kl"] = float((k3_kl(rollout, old) * mask).sum())
        if correction is not None:
            stats.update(correction.stats)
        stats["loss"] = float(total.detach())
        return total, stats

    def _reduce(self, sums: dict[str, float], global_tokens: float) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        out = {}
        for k, v in zip(keys, t.tolist(), strict=True):
            if k.startswith("_"):
                out[k[1:]] = v / max(global_tokens, 1.0)
            else:
                out[k] = v  # already normalised by the global denominator
        return out

    def _join_group(self, group: dict) -> None:
        from miles_core.weights.group import open_group

        self._transfer_group = open_group(group["host"], group["port"], self.rank, group["world"])

    def _send_shards(self, engine_ranks: list[int], dtype: torch.dtype | None = None) -> int:
        pg = self._transfer_group[1]
        sent = 0
        with torch.no_grad():
            for tag, (_, param) in enumerate(self.model.named_parameters()):
                local = param.to_local() if isinstance(param, DTensor) else param
                local = local.detach().to(dtype or local.dtype).contiguous()
                if local.numel() == 0:
                    continue
                for dst in engine_ranks:
                    pg.send([local], dst, tag).wait()
                    sent += local.numel() * local.element_size()
        return sent

    def _named_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full tensors (rank 0). Every rank runs one all-gather per parameter, so if
        rank 0's consumer stops early (an error mid-push), the rest are still run in `finally`:
        the followers never wait in a collective that rank 0 skipped."""
        params = list(self.model.named_parameters())
        done = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        try:
            with torch.no_grad():
                for name, param in params:
                    full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                    done += 1
                    if self.rank != 0:
                        continue
                    if dtype is not None:
                        full = full.to(dtype)
                    bucket.append((name, full))
                    size += full.numel() * full.element_size()
                    if size >= bucket_bytes:
                        yield bucket
                        bucket, size = [], 0
            if bucket:
                yield bucket
        finally:
            with torch.no_grad():
                for _, param in params[done:]:
                    if isinstance(param, DTensor):
                        param.full_tensor()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: every tensor unsharded, HF names, tied duplicates dropped."""
        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if getattr(self.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in sd.items()}

    def _save(self, directory: str) -> None:
        path = Path(directory)
        sd = self.full_state_dict()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.config.save_pretrained(str(path))
            save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
            with open(path / "trainer_state.json", "w") as f:
                json.dump({"scheduler": self.scheduler.state_dict(), "world_size": self.world}, f)
        osd = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.save({"optimizer": osd}, checkpoint_id=str(path / "optimizer"))
        if self.world > 1:
            dist.barrier()

    def _load(self, directory: str) -> None:
        path = Path(directory)
        sd = load_file(str(path / "model.safetensors")) if self.rank == 0 else {}
        if getattr(self.config, "tie_word_embeddings", False) and self.rank == 0:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        set_model_state_dict(
            self.model,
            sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
        )
        if (path / "optimizer").exists():
            osd = get_optimizer_state_dict(self.model, self.optimizer)
            dcp.load({"optimizer": osd}, checkpoint_id=str(path / "optimizer"))
            set_optimizer_state_dict(self.model, self.optimizer, osd)
        state_file = path / "trainer_state.json"
        if state_file.exists():
            with open(state_file) as f:
                self.scheduler.load_state_dict(json.load(f)["scheduler"])
