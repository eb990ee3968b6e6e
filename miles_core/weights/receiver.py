"""The engine's side of the group transports (broadcast, p2p): the groups it joined and the
tensors it staged, loaded all or nothing by the call that carries the new version.

A receive that fails (a refused bucket, a sender that goes away, a load the model refuses)
drops everything staged for that group, so the next push loads exactly what it sends and never
a mix with the remains of a failed one. A refused bucket whose layout is known is still received
(into scratch buffers, then dropped) so the trainer's broadcast does not wait on us; but a body
that could not come from a trainer of this model (a tensor named twice, more elements than the
model holds, negative dimensions, p2p pieces from ranks that are not trainer ranks) is refused
before anything is allocated or received: those buffers are sized by the request.

The engine server's routes only translate HTTP to these calls (engines/cpu/server.py); `load` is the
engine's `update_weights_from_tensor(tensors, flush_cache, adopt)` and `params` its
{name: tensor} (names and shapes are checked before a single byte is kept).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miles_core.device import dist_backend
from miles_core.weights.group import (
    BACKENDS,
    DTYPES,
    Scratch,
    broadcast,
    flat_layout,
    fresh,
    open_group,
    receive_bucket,
    receive_shards,
    recv_flat,
)
from miles_core.weights.source import TensorPlan, check_plan

P2P_FORMAT = "p2p_shards"
# the wire alone, for benchmarks/weight_sync.py's raw rows: a bucket's bytes received as the
# transport's wire sends them (after a one-element broadcast from rank 0 that starts the
# sender's clock) into buffers kept for the next probe, then dropped: nothing staged or loaded,
# bounded by the model's size like any push
PROBE_FORMAT = "wire_probe"


class ReceiveRefused(ValueError):
    """The push cannot be taken (bad metadata, names or shapes this model lacks, a failed
    transfer); nothing of it is staged any more and the engine keeps its weights."""


@dataclass
class _Group:
    store: object
    pg: object
    rank: int  # this engine's rank: trainer ranks (the senders) come before it
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    probe: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # PROBE_FORMAT's
    # CPU receive buffers in two sets, kept from push to push (a fresh buffer is mostly page
    # faults): a push fills the set the parameters are not views of (`live`: the set of the
    # last load, which the engine adopted), so a push never writes what the engine serves from
    sets: tuple[Scratch, Scratch] = field(default_factory=lambda: (Scratch(), Scratch()))
    live: int | None = None
    filling: int = 0
    busy: threading.Lock = field(default_factory=threading.Lock)  # one receive at a time


class GroupReceiver:
    def __init__(
        self,
        params: Callable[[], dict[str, torch.Tensor]],
        load: Callable[[list, bool], None],
        device: str | torch.device = "cpu",
        timeout_s: float = 120.0,
    ):
        self._params = params
        self._load = load  # load(tensors, flush_cache): all or nothing, raises KeyError/ValueError
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._groups: dict[str, _Group] = {}

    # ------------------------------------------------------------------ groups
    def join(self, name: str, host: str, port: int, rank: int, world: int, backend: str) -> None:
        """Joins the trainer's group as `rank` (blocks until every member is in)."""
        want = dist_backend(self.device)
        if backend not in BACKENDS or backend != want:
            raise ReceiveRefused(
                f"backend {backend!r} does not fit this engine's device ({self.device}); "
                f"use {want!r}"
            )
        if name in self._groups:
            raise ReceiveRefused(f"weight update group {name!r} already exists")
        if not 1 <= rank < world:  # rank 0 is the trainer's sending rank (the broadcast root)
            raise ReceiveRefused(
                f"rank_offset {rank} in a group of {world}: an engine joins as one of ranks "
                f"1..{world - 1}, after the trainer ranks that send"
            )
        if _wildcard(host):
            raise ReceiveRefused(
                f"master_address {host!r} is not an address: give the trainer's (127.0.0.1 on "
                "one host)"
            )
        _reachable(host, port, min(PROBE_TIMEOUT_S, self.timeout_s))
        try:
            store, pg = open_group(host, port, rank, world, self.timeout_s, backend)
        except Exception as e:  # noqa: BLE001  (rendezvous failures: timeout, refused)
            raise ReceiveRefused(f"could not join weight update group {name!r}: {e}") from e
        self._groups[name] = _Group(store, pg, rank)

    def leave(self, name: str) -> None:
        if self._groups.pop(name, None) is None:
            raise ReceiveRefused(f"no weight update group {name!r}")

    def staged(self, name: str) -> int:
        """How many tensors are staged for group `name` (0 after any failure)."""
        group = self._groups.get(name)
        return 0 if group is None else len(group.staged)

    # ------------------------------------------------------------------ receive
    def receive(
        self,
        name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        last: bool,
        flush_cache: bool = True,
        load_format: str | None = None,
        plan: list[dict] | None = None,
        senders: int | None = None,
    ) -> int:
        """One bucket (broadcast) or the whole plan (p2p); with `last`, loads everything staged
        (all or nothing). Returns the tensors received. Any failure drops what was staged."""
        group = self._groups.get(name)
        if group is None:
            raise ReceiveRefused(f"no weight update group {name!r}; init it first")
        if not group.busy.acquire(blocking=False):  # a second call would interleave the wire
            raise ReceiveRefused(f"weight update group {name!r} is receiving another push")
        try:
            if not group.staged:  # a push starts: the set the engine does not serve from
                group.filling = 1 if group.live == 0 else 0
                group.sets[group.filling].start()
            if load_format == PROBE_FORMAT:
                if last:
                    raise ReceiveRefused("a wire probe loads nothing: send it without a version")
                self._probe(group, names, dtypes, shapes, senders)
                return 0
            if load_format == P2P_FORMAT:
                received = self._receive_plan(group, names, plan, senders)
            elif load_format:
                raise ReceiveRefused(f"load_format {load_format!r} is not supported here")
            else:
                received = self._receive_bucket(group, names, dtypes, shapes)
            group.staged += received
            if last:
                tensors, group.staged = group.staged, []
                if not tensors:  # a version with no weights behind it: refused, version kept
                    raise ReceiveRefused("nothing was received for this push; nothing to load")
                try:
                    self._load(tensors, flush_cache)
                except (KeyError, ValueError) as e:
                    raise ReceiveRefused(f"weights do not fit this model: {e}") from e
                group.live = group.filling  # the parameters may be views of this set now
            return len(received)
        except BaseException:
            group.staged = []  # a failed push leaves nothing behind for the next one
            raise
        finally:
            group.busy.release()

    def _receive_bucket(self, group: _Group, names, dtypes, shapes) -> list:
        try:
            flat_layout(names, dtypes, shapes)
        except (ValueError, OverflowError) as e:  # sizes unknown: nothing received in step
            raise ReceiveRefused(str(e)) from e
        self._check_size(group, names, shapes)
        refusal = self._misfit(list(zip(names, shapes, strict=True)))
        received = _transfer(
            receive_bucket, group.pg, names, dtypes, shapes, self.device, self._alloc(group)
        )
        if refusal:  # received in step with the sender, then dropped
            raise ReceiveRefused(f"weights do not fit this model: {refusal}")
        return received

    def _receive_plan(self, group: _Group, names, plan, senders) -> list:
        try:
            tensors = [TensorPlan.from_json(t) for t in plan or []]
            check_plan(tensors, int(senders or 0))
            flat_layout(names, [t.dtype for t in tensors], [t.shape for t in tensors])
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            # sizes unknown: cannot stay in step with the senders
            raise ReceiveRefused(f"malformed p2p placement plan: {e!r}") from e
        if [t.name for t in tensors] != list(names):
            raise ReceiveRefused("the p2p plan does not list the names of the request")
        if not 0 < int(senders or 0) <= group.rank:
            raise ReceiveRefused(
                f"senders={senders}: the trainer ranks are 0..{group.rank - 1} of this group"
            )
        self._check_size(group, names, [t.shape for t in tensors])
        refusal = self._misfit([(t.name, t.shape) for t in tensors])
        received = _transfer(receive_shards, group.pg, tensors, self.device, self._alloc(group))
        if refusal:  # received in step with the senders, then dropped
            raise ReceiveRefused(f"weights do not fit this model: {refusal}")
        return received

    def _alloc(self, group: _Group):
        """Kept buffers on CPU; on CUDA the caching allocator already reuses its memory."""
        return group.sets[group.filling].take if self.device.type == "cpu" else fresh

    def drop_buffers(self) -> None:
        """Lets the kept receive buffers go (the engine releases its memory): the next push
        allocates again."""
        for group in self._groups.values():
            for scratch in group.sets:
                scratch.clear()
            group.probe.clear()

    def _probe(self, group: _Group, names, dtypes, shapes, senders) -> None:
        """PROBE_FORMAT: per dtype, one flat buffer broadcast from rank 0 (`senders` unset, the
        broadcast wire) or sent by rank 0 alone (`senders` 1, the p2p wire)."""
        try:
            sizes, _ = flat_layout(names, dtypes, shapes)
        except (ValueError, OverflowError) as e:
            raise ReceiveRefused(str(e)) from e
        if senders not in (None, 1):
            raise ReceiveRefused("a wire probe has one sender, rank 0")
        self._check_size(group, names, shapes)
        for dtype, n in sizes.items():  # one buffer per dtype and size (bucket)
            if (dtype, n) not in group.probe:
                group.probe[(dtype, n)] = torch.empty(n, dtype=DTYPES[dtype], device=self.device)

        def wire(pg) -> list:
            broadcast(pg, torch.zeros(1, device=self.device))  # the sender's clock starts here
            for tag, dtype in enumerate(sorted(sizes)):
                if senders is None:
                    broadcast(pg, group.probe[(dtype, sizes[dtype])])
                else:
                    for w in recv_flat(pg, group.probe[(dtype, sizes[dtype])], 0, tag):
                        w.wait()
            return []

        _transfer(wire, group.pg)

    def _check_size(self, group: _Group, names, shapes) -> None:
        """Refuses, before allocating anything, a push larger than this model (what is staged
        plus this request, in elements) or naming a tensor twice: the buffers a misfit is
        received into are sized by the request, so a hostile body must not size them."""
        if len(set(names)) != len(names):
            raise ReceiveRefused("the push names a tensor more than once")
        limit = sum(p.numel() for p in self._params().values())
        count = sum(t.numel() for _, t in group.staged)
        for shape in shapes:
            n = 1
            for d in shape:
                n *= int(d)
            count += n
        if count > limit:
            raise ReceiveRefused(f"the push holds {count} elements, more than this model's {limit}")

    def _misfit(self, shapes: list[tuple[str, list[int]]]) -> str:
        params = self._params()
        for name, shape in shapes:
            p = params.get(name)
            if p is None:
                return f"engine has no parameter named {name!r}"
            if list(p.shape) != list(shape):
                return f"{name}: engine shape {tuple(p.shape)} != pushed {tuple(shape)}"
        return ""


def _wildcard(host: str) -> bool:
    """0.0.0.0, ::, an empty name: listening there would open the engine on every interface."""
    try:
        return not host or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


def _transfer(receive: Callable[..., list], *args) -> list:
    """A receive whose transfer failed (a sender that went away, a timeout: gloo / nccl raise
    RuntimeError) is refused like any other push, not an engine error."""
    try:
        return receive(*args)
    except RuntimeError as e:
        raise ReceiveRefused(f"the transfer failed: {e}") from e


PROBE_TIMEOUT_S = 5.0  # the trainer's store listens before it asks an engine to join


def _reachable(host: str, port: int, timeout_s: float) -> None:
    """Fails fast where the rendezvous would wait its whole timeout: an address that does not
    resolve, or a port where nothing listens (the trainer opens its store before it asks)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ReceiveRefused(
            f"no weight-group rendezvous answers at {host}:{port} ({e.strerror or e}); the "
            "trainer opens it before it asks engines to join"
        ) from e
