"""The public calls every trainer backend makes the same way under torchrun: rank 0 announces
the call (`distributed.announce`) and every rank runs `_<name>` with the same arguments
(`distributed.follow` on the others), so their collectives line up. A backend inherits these and
implements the `_<name>` methods it needs; `_compute_log_probs` and `_train_step` are the shared
step loop's (`miles_core.train.step`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from miles_core.train import distributed as spmd
from miles_core.train import step as steps
from miles_core.train.backend import backend_path
from miles_core.train.batch import TrainBatch
from miles_core.train.kept_weights import KeptWeights
from miles_core.train.loss import LOSSES, loss_options
from miles_core.train.routing_replay import RouteReplay


class SPMDCalls:
    loss_cfg: dict[str, Any]
    model: torch.nn.Module  # the policy's modules on this rank
    routing: RouteReplay | None = None  # MoE routing replay / its checker, when the run asks
    _kept: KeptWeights | None = None  # earlier versions' parameters (`keep_weights`)

    def take_stats(self) -> dict[str, float]:
        """This rank's forwards' own counts since the last call (the routing checker's), which
        the step sums over ranks like its loss statistics."""
        return self.routing.take_counts() if self.routing is not None else {}

    def _announce_init(self, **kwargs: Any) -> None:
        """Followers build this class with the same keyword arguments."""
        spmd.announce_init(backend_path(type(self)), kwargs)

    def _needs_reference(self) -> bool:
        """The run's RL loss (`loss.loss`, default policy) asks for reference log-probs."""
        if not self.loss_cfg:
            return False
        name = self.loss_cfg.get("loss") or "policy"
        fn = LOSSES.get(name)
        return fn.needs(fn.config(loss_options(self.loss_cfg, name))).reference

    # ------------------------------------------------------------------ public calls (rank 0)
    def compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        spmd.announce("compute_log_probs", (batch,))
        return self._compute_log_probs(batch)

    def train_step(self, batch: TrainBatch, loss: str = "policy") -> dict[str, float]:
        spmd.announce("train_step", (batch, loss))
        return self._train_step(batch, loss)

    def keep_weights(self, version: int, oldest: int) -> None:
        """Keeps a copy of the current weights as policy `version` and forgets the copies of
        versions before `oldest` (`compute_log_probs_at` computes under a kept one)."""
        spmd.announce("keep_weights", (version, oldest))
        self._keep_weights(version, oldest)

    def kept_versions(self) -> list[int]:
        return [] if self._kept is None else self._kept.versions()

    def compute_log_probs_at(self, version: int, batch: TrainBatch) -> list[list[float]]:
        """`compute_log_probs` under the weights kept as `version`; the trainer's own are
        back afterwards."""
        spmd.announce("compute_log_probs_at", (version, batch))
        return self._compute_log_probs_at(version, batch)

    def save(self, directory: str) -> None:
        spmd.announce("save", (directory,))
        self._save(directory)

    def load(self, directory: str) -> None:
        spmd.announce("load", (directory,))
        self._load(directory)

    def close(self) -> None:
        spmd.announce("close", None)

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        spmd.announce("named_weights", (bucket_bytes, dtype))
        return self._named_weights(bucket_bytes, dtype)

    def join_group(self, group: dict) -> None:
        """Every rank joins the weight-transfer group {host, port, world, backend} as its own
        rank."""
        spmd.announce("join_group", (group,))
        self._join_group(group)

    def send_shards(
        self, engine_ranks: list[int], dtype: torch.dtype | None = None, precision=None
    ) -> int:
        """p2p push: every rank sends its pieces of `shard_plan` (cast to `dtype` if given;
        with `precision`, quantized weights as their parts) to each engine rank of the joined
        group (no gather). Returns the bytes this rank sent."""
        spmd.announce("send_shards", (engine_ranks, dtype, precision))
        return self._send_shards(engine_ranks, dtype, precision)

    # ------------------------------------------------------------------ implementations (all ranks)
    def _compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        return steps.compute_log_probs(self, batch)  # type: ignore[arg-type]

    def _train_step(self, batch: TrainBatch, loss: str) -> dict[str, float]:
        return steps.train_step(self, batch, loss, self.loss_cfg)  # type: ignore[arg-type]

    def _keep_weights(self, version: int, oldest: int) -> None:
        if self._kept is None:
            self._kept = KeptWeights()
        self._kept.keep(version, self.model, oldest)

    def _compute_log_probs_at(self, version: int, batch: TrainBatch) -> list[list[float]]:
        if self._kept is None or version not in self._kept:
            raise KeyError(f"no weights kept for policy version {version}")
        with self._kept.swapped_in(version, self.model):
            return self._compute_log_probs(batch)

    def _join_group(self, group: dict) -> None:
        from miles_core.weights.group import open_group

        self._transfer_group = open_group(
            group["host"],
            group["port"],
            self.rank,  # type: ignore[attr-defined]
            group["world"],
            backend=group.get("backend", "gloo"),
        )

    def _save(self, directory: str) -> None:
        raise NotImplementedError

    def _load(self, directory: str) -> None:
        raise NotImplementedError

    def _named_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        raise NotImplementedError

    def _send_shards(self, engine_ranks: list[int], dtype: torch.dtype | None = None) -> int:
        raise NotImplementedError
