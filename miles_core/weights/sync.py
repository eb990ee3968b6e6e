"""Weight sync of a run: the transport (`weight_sync.transport`, from the transport registry)
between the trainer and the engine fleet, the policy versions on both sides, and the weights
lock.

The lock (`exclusive()`) is held by everything that reads or writes the trainer's weights — a
train phase, a push, the equality check, a checkpoint's save / load — so the supervisor's push
to a replaced engine server (`serve_current_weights`) never reads them mid-update. A push from a
`WeightSnapshot` (the trainer's weights copied at a hand-over, pushed while it trains on) reads
no trainer weights and holds only the transport's lock, which every push and check holds, so two
pushes never interleave.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from miles_core.device import dist_backend
from miles_core.engines.fleet import EngineFleet
from miles_core.lora.names import WIRE_PREFIX
from miles_core.precision.plan import QuantPlan
from miles_core.precision.push import QuantizedSource
from miles_core.train.backend import TrainerBackend
from miles_core.weights import TRANSPORTS, TransportContext, weights_checksum
from miles_core.weights.source import TensorBuckets

log = logging.getLogger("miles")

_CHECK_BUCKET = 64 << 20  # bucket size of the trainer's weights read for checksums


@dataclass
class WeightSnapshot:
    """The trainer's weights at one policy version, copied in the transport's buckets: what a
    push sends while the trainer goes on, and what the engines must then hold."""

    version: int
    source: TensorBuckets
    checksum: str | None = None  # weights_checksum the engines must answer (check_equal)
    # multi-LoRA: the adapters the push carries (those that stepped; None: everything copied)
    adapters: list[str] | None = None


def adapter_buckets(snap: WeightSnapshot) -> TensorBuckets:
    """The snapshot's buckets with the tensors of its `adapters` alone (wire names)."""
    keep = tuple(f"{WIRE_PREFIX}{a}." for a in snap.adapters or ())
    buckets = [[(n, t) for n, t in b if n.startswith(keep)] for b in snap.source.buckets]
    return TensorBuckets([b for b in buckets if b])


class WeightSync:
    """`policy_version`: training steps the trainer's weights hold (pushed or about to be);
    `engine_version`: the version the engines serve (= policy_version after a push)."""

    def __init__(
        self,
        config,
        trainer: TrainerBackend,
        fleet: EngineFleet,
        workdir,
        plan: QuantPlan | None = None,
    ):
        ws = config.weight_sync
        self.config = config
        self.trainer = trainer
        self.fleet = fleet
        self.lock = threading.RLock()
        self.push_lock = threading.RLock()  # the transport: one push or check at a time
        self.policy_version = 0
        self.engine_version = 0
        self.trained_since_push = False  # the trainer is one version ahead of policy_version
        self.plan = plan  # rollout.precision: pushes carry quantized weights (precision/push.py)
        # train.lora: pushes carry the adapters alone, and checks compare them (the frozen base
        # is compared once, `check_base`)
        self.scope = "adapters" if config.train.lora is not None else "all"
        # multi-LoRA: the adapters that took a step since the last push (only they are pushed)
        lora = config.train.lora
        self.stepped: set[str] | None = set() if lora and len(lora.adapters) > 1 else None
        context = TransportContext.of_run(config, workdir, dist_backend(trainer.device))
        self.transport = TRANSPORTS.get(ws.transport).build(context, ws.transport_options)
        try:  # a transport/engine mismatch refused here leaves nothing open
            self.transport.connect(fleet.engines)
        except BaseException:
            self.transport.close()
            raise

    def exclusive(self) -> threading.RLock:
        """The weights lock, as a context manager (re-entrant)."""
        return self.lock

    @property
    def reconnects(self) -> bool:
        """Whether the transport can serve a replaced engine server."""
        return bool(self.transport.reconnects)

    @property
    def push_dtype(self) -> torch.dtype | None:
        """The dtype pushes round the weights to; None: exact (float32)."""
        name = self.config.weight_sync.dtype
        return None if name == "float32" else getattr(torch, name)

    @property
    def trainer_version(self) -> int:
        """The policy version the trainer's weights hold now (one ahead of `policy_version`
        when it trained since the last push)."""
        return self.policy_version + int(self.trained_since_push)

    def trained(self, adapters: list[str] | None = None) -> None:
        """The trainer took an optimizer step since the last push (call under the lock); with
        several LoRA adapters, those of `adapters` did."""
        self.trained_since_push = True
        if self.stepped is not None:
            self.stepped |= set(adapters or ())

    def _take_stepped(self) -> list[str] | None:
        """The adapters the next push carries (None: all the trainer pushes)."""
        if not self.stepped:
            return None
        names, self.stepped = sorted(self.stepped), set()
        return names

    def next_version(self) -> int:
        """The version the next push carries; a replacement engine gets it from now on."""
        with self.lock:
            self.policy_version += 1
            self.trained_since_push = False
        return self.policy_version

    def push(self, version: int, pause_mode: str):
        """Pushes the trainer's weights as `version` (multi-LoRA: the adapters that stepped); a
        push that meets a dead engine server waits for its replacement (which got the
        trainer's weights) and is made once more."""
        with self.lock:
            adapters = self._take_stepped()
        return self.fleet.surviving(
            f"push of version {version}", self.push_now, version, pause_mode, adapters
        )

    def push_now(self, version: int, pause_mode: str, adapters: list[str] | None = None):
        # the transport reads the trainer (buckets or shards) with weight_sync's bucket and dtype
        with self.lock, self.push_lock:
            if adapters is None:
                return self.transport.push(self._source(self.trainer), version, pause_mode)
            self.trainer.push_only(adapters)
            try:
                return self.transport.push(self._source(self.trainer), version, pause_mode)
            finally:
                self.trainer.push_only(None)

    @property
    def snapshots(self) -> bool:
        """Whether the transport can push a snapshot (it reads full tensors, not shards)."""
        return bool(getattr(self.transport, "snapshots", False))

    def snapshot(self) -> WeightSnapshot:
        """The next policy version and a copy of the trainer's weights as the transport reads
        them (its bucket size; the push dtype applied when pushed), taken under the weights
        lock: the trainer may train on while it is pushed."""
        with self.lock:
            version = self.next_version()
            buckets = [
                [(n, t.detach().clone()) for n, t in bucket]
                for bucket in self.trainer.named_weights(self.transport.bucket_bytes)
            ]
            adapters = self._take_stepped()
        checksum = None
        if self.config.weight_sync.check_equal:
            checksum = weights_checksum(self._as_loaded(TensorBuckets(buckets)))
        return WeightSnapshot(version, TensorBuckets(buckets), checksum, adapters)

    def push_snapshot(self, snap: WeightSnapshot, pause_mode: str):
        """Pushes `snap` as its version (the trainer's weights are not read: no weights lock);
        with `check_equal`, the engines are checked against it in the same hold of the
        transport, so a replaced engine's push cannot come in between."""

        def push_and_check():
            with self.push_lock:
                source = snap.source if snap.adapters is None else adapter_buckets(snap)
                stats = self.transport.push(self._source(source), snap.version, pause_mode)
                held = self.fleet.engine.weights_checksum(self.scope)
                if snap.checksum is not None and held != snap.checksum:
                    raise RuntimeError(
                        f"engine weights ({self.fleet.where}) differ from the snapshot of "
                        f"version {snap.version} after its push"
                    )
                return stats

        return self.fleet.surviving(f"push of version {snap.version}", push_and_check)

    def _source(self, weights):
        """What a push of `weights` sends: with rollout.precision, quantized."""
        return weights if self.plan is None else QuantizedSource(weights, self.plan)

    def _as_loaded(self, weights) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) as the engines hold them after a push of `weights`: rounded to the
        push dtype and loaded into their own (float32) parameters; quantized weights as the
        parts pushed."""
        dtype = self.push_dtype
        if self.plan is None:
            named = (n_t for b in weights.named_weights(_CHECK_BUCKET) for n_t in b)
            return [(n, t.to(dtype).to(t.dtype) if dtype is not None else t) for n, t in named]
        source = QuantizedSource(weights, self.plan)
        named = [n_t for b in source.named_weights(_CHECK_BUCKET, dtype) for n_t in b]
        return [(n, t if n in source.part_names else t.float()) for n, t in named]

    def serve_current_weights(self, engine) -> None:
        """Called by the supervisor for a fresh engine server (its client `engine`), before it
        serves: the transport reconnects to it alone (a disk transport's next push is full),
        the trainer's current weights go out with their version, and the transport reconnects
        to every engine; `check_equal` verifies them."""
        with self.lock, self.push_lock:
            version = self.trainer_version
            self.transport.connect([engine])
            try:
                stats = self.push_now(version, "abort")
            finally:
                self.transport.connect(self.fleet.engines)
            log.warning(
                "replaced engine server got policy version %d (%d bytes in %.2f s)",
                version,
                stats.bytes,
                stats.seconds,
            )
            if self.config.weight_sync.check_equal:
                # the replacement alone: behind a router the others keep the last push until
                # the next one, and the trainer may have stepped since
                self.check_now(engine)

    def check_equal(self) -> None:
        """The engines hold exactly what was pushed: the trainer's weights, in the push dtype,
        loaded into the engine's own (fp32) parameters."""
        self.fleet.surviving("weights check", self.check_now)

    def check_now(self, engine=None) -> None:
        """`engine` (default: every engine of the fleet) holds the trainer's weights now."""
        target = engine or self.fleet.engine
        with self.lock, self.push_lock:
            expected = self._as_loaded(self.trainer)
            if target.weights_checksum(self.scope) != weights_checksum(expected):
                where = getattr(target, "url", self.fleet.where)
                raise RuntimeError(
                    f"engine weights ({where}) differ from the trainer's after the push"
                )

    def check_base(self, base: dict[str, torch.Tensor]) -> None:
        """LoRA: the engines serve the frozen base the trainer holds (`base`: the run's starting
        model, which a LoRA trainer never changes)."""
        expected = weights_checksum(base.items())
        held = self.fleet.surviving(
            "base weights check", self.fleet.engine.weights_checksum, "base"
        )
        if held != expected:
            raise RuntimeError(f"engine base weights ({self.fleet.where}) differ from the run's")

    def trainer_checksum(self, engine_checksum: str) -> str:
        """sha256 of the trainer's weights (what a checkpoint's files hold): the engine's, which
        holds them as they are unless pushes round or quantize them (weight_sync.dtype,
        rollout.precision)."""
        if self.push_dtype is None and self.plan is None and self.scope == "all":
            return engine_checksum
        with self.lock:
            return weights_checksum(
                n_t for b in self.trainer.named_weights(_CHECK_BUCKET) for n_t in b
            )

    def close(self) -> None:
        """Closes the transport (while the engines still answer)."""
        self.transport.close()
