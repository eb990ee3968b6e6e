"""A standalone process group between a trainer's sending ranks and engine processes, apart
from any default group (the trainer's ranks keep theirs): a TCPStore rendezvous hosted in the
trainer's process (bound to port 0, or within a range, and the port it got passed on: no
choose-then-bind race), then a process group bound to it: gloo for CPU tensors, nccl for CUDA
tensors (`miles_core.device.dist_backend(device)`). SGLang's `/init_weights_update_group` builds the same thing.

Both halves of the wire format live here: a bucket flattened per dtype and broadcast
(`send_bucket` / `receive_bucket`), and p2p shards: each trainer rank sends everything it holds to
each engine as one flat buffer per dtype, its pieces in plan order (`send_pieces`, called by the
backend's `send_shards`), and the engine assembles full tensors from the plan (`receive_shards`).
Every flat buffer travels as STREAMS concurrent chunks (`broadcast`, `send_flat` / `recv_flat`):
one message per bucket or per rank and dtype, never one per tensor."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from miles_core.weights.source import WIRE_DTYPES, TensorPlan, wire_view

BACKENDS = ("gloo", "nccl")


def host_store(
    host: str, world_size: int, timeout_s: float = 120.0, ports: range | None = None
) -> TCPStore:
    """The rendezvous, hosted here: listening on `host` only (127.0.0.1 by default in the
    transports; TCPStore on its own would listen on every interface), on port 0 or the first
    free port of `ports`; every member, this process's too, joins it with
    `open_group(host, store.port, …)`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    last: Exception | None = None
    for port in ports or (0,):
        try:
            fd = _listening_socket(host, port)
        except OSError as e:  # that port is taken: the next one
            last = e
            continue
        try:  # the store owns the descriptor from here on
            return TCPStore(
                host,
                port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except (RuntimeError, OSError) as e:
            os.close(fd)
            last = e
    raise OSError(f"no free port for the weight-group rendezvous on {host} in {ports}: {last}")


def _listening_socket(host: str, port: int) -> int:
    """A TCP socket bound to host:port and listening; its descriptor (detached)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def local_address(peer: str) -> str:
    """The address of this host's interface that reaches `peer` (no packet is sent): what a
    member's gloo pairs listen on, instead of every interface or the peer's own address."""
    family = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family[0], socket.SOCK_DGRAM) as s:
        s.connect(family[4][:2] if family[0] == socket.AF_INET else family[4])
        return s.getsockname()[0]


STREAMS = 2  # TCP connections per peer: one stream tops out near 1.5 GB/s on loopback, two ≈4.5


def open_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> tuple[TCPStore, torch.distributed.ProcessGroup]:
    """Joins the rendezvous at host:port (hosted by `host_store`) as `rank`; returns once all
    `world_size` ranks are in."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-group backend {backend!r}; choose one of {BACKENDS}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        nccl = ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return store, ProcessGroupNCCL(store, rank, world_size, nccl)
    opts = ProcessGroupGloo._Options()
    here = local_address(host)  # this member's pairs listen on the interface towards host
    opts._devices = [ProcessGroupGloo.create_device(hostname=here) for _ in range(STREAMS)]
    opts._threads = STREAMS
    opts._timeout = timeout
    return store, ProcessGroupGloo(store, rank, world_size, opts)


def broadcast(pg: ProcessGroupGloo, flat: torch.Tensor) -> None:
    """Broadcasts a flat buffer from rank 0 as STREAMS concurrent chunks (same split on every
    rank: `torch.chunk` of equal sizes)."""
    works = [pg.broadcast(chunk, 0) for chunk in wire_view(flat).chunk(STREAMS)]
    for w in works:
        w.wait()


def send_flat(pg, flat: torch.Tensor, dst: int, tag: int = 0) -> list:
    """Starts sending a flat buffer to rank `dst` as STREAMS chunks (tags tag*STREAMS + i: gloo
    puts each tag on its own connection); the works, to wait on."""
    chunks = wire_view(flat).chunk(STREAMS)
    return [pg.send([c], dst, tag * STREAMS + i) for i, c in enumerate(chunks)]


def recv_flat(pg, flat: torch.Tensor, src: int, tag: int = 0) -> list:
    """Starts receiving `send_flat`'s buffer from rank `src` into `flat`; the works."""
    chunks = wire_view(flat).chunk(STREAMS)
    return [pg.recv([c], src, tag * STREAMS + i) for i, c in enumerate(chunks)]


Alloc = Callable[[int, torch.dtype, torch.device], torch.Tensor]  # (elements, dtype, device)


def fresh(n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=device)


class Scratch:
    """Flat buffers kept from one use to the next, handed out in order (`take`) after `start`:
    a fresh CPU buffer of a bucket's size is mostly page faults (126 MB: 71 ms to fill against
    12 ms for one already touched, on the 2-core benchmark machine)."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []
        self._next = 0

    def start(self) -> None:
        self._next = 0

    def take(self, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        i = self._next
        self._next += 1
        if i == len(self._held):
            self._held.append(torch.empty(0, dtype=dtype, device=device))
        held = self._held[i]
        if held.dtype != dtype or held.device != torch.device(device) or held.numel() < n:
            held = self._held[i] = torch.empty(n, dtype=dtype, device=device)
        return held[:n]

    def clear(self) -> None:
        self._held = []
        self._next = 0


def send_bucket(
    pg: ProcessGroupGloo, bucket: list[tuple[str, torch.Tensor]], scratch: Scratch | None = None
) -> int:
    """Rank 0's half of a bucket: one flat broadcast per dtype (sorted), tensors in bucket
    order, flattened into `scratch`'s buffers if given. Returns the bytes sent."""
    sent = 0
    for dtype in sorted({_name(t.dtype) for _, t in bucket}):
        parts = [t.detach().reshape(-1) for _, t in bucket if _name(t.dtype) == dtype]
        if scratch is None:
            flat = torch.cat(parts)
        else:
            n = sum(p.numel() for p in parts)
            flat = torch.cat(parts, out=scratch.take(n, parts[0].dtype, parts[0].device))
        broadcast(pg, flat)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_bucket(
    pg, names, dtypes, shapes, device: str | torch.device = "cpu", alloc: Alloc = fresh
) -> list[tuple[str, torch.Tensor]]:
    """An engine's half of `send_bucket`: views into the received flat buffers (on `device`,
    from `alloc`)."""
    sizes, layout = flat_layout(names, dtypes, shapes)
    flats = {}
    for dtype in sorted(sizes):
        flats[dtype] = alloc(sizes[dtype], DTYPES[dtype], torch.device(device))
        broadcast(pg, flats[dtype])
    out = []
    for name, dtype, shape, offset in layout:
        count = 1
        for d in shape:
            count *= d
        out.append((name, flats[dtype][offset : offset + count].view(shape)))
    return out


def rank_layout(plan: list[TensorPlan], rank: int) -> dict[str, list[tuple[int, int, int]]]:
    """What trainer `rank` sends under `plan`: per dtype (sorted), its non-empty pieces in plan
    order as (tensor index, offset in the flat buffer, elements)."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(plan):
        for p in t.pieces:
            if p.rank != rank or p.length == 0:
                continue
            count = p.length
            for d, n in enumerate(t.shape):
                if d != p.dim:
                    count *= n
            pieces = out.setdefault(t.dtype, [])
            offset = pieces[-1][1] + pieces[-1][2] if pieces else 0
            pieces.append((i, offset, count))
    return dict(sorted(out.items()))


def send_pieces(
    pg,
    plan: list[TensorPlan],
    rank: int,
    pieces: dict[int, torch.Tensor],
    engine_ranks: list[int],
    scratch: Scratch | None = None,
) -> int:
    """A trainer rank's half of p2p: its `pieces` ({tensor index in the plan: the slice it holds,
    in the dtype sent}) flattened per dtype (into `scratch`'s buffers if given) and sent to every
    engine rank at once (all sends started, then waited on). Returns the bytes sent."""
    works, sent = [], 0
    if scratch is not None:
        scratch.start()
    for tag, (_, layout) in enumerate(rank_layout(plan, rank).items()):
        parts = [pieces[i].reshape(-1) for i, _, _ in layout]
        if scratch is None:
            flat = torch.cat(parts)
        else:
            n = sum(p.numel() for p in parts)
            flat = torch.cat(parts, out=scratch.take(n, parts[0].dtype, parts[0].device))
        for dst in engine_ranks:
            works += send_flat(pg, flat, dst, tag)
            sent += flat.numel() * flat.element_size()
    for w in works:
        w.wait()
    return sent


def receive_shards(
    pg, plan: list[TensorPlan], device: str | torch.device = "cpu", alloc: Alloc = fresh
) -> list[tuple[str, torch.Tensor]]:
    """An engine's half of p2p: one flat buffer per trainer rank and dtype (`send_pieces`), all
    received at once, then each tensor assembled from the pieces its plan names (a tensor sent
    whole by one rank is a view of that rank's buffer, no copy)."""
    for t in plan:
        if t.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {t.dtype!r} for {t.name}")
    works, slices = [], {}
    for rank in sorted({p.rank for t in plan for p in t.pieces}):
        for tag, (dtype, layout) in enumerate(rank_layout(plan, rank).items()):
            n = layout[-1][1] + layout[-1][2]
            flat = alloc(n, DTYPES[dtype], torch.device(device))
            works += recv_flat(pg, flat, rank, tag)
            for i, offset, count in layout:  # a rank's pieces of tensor i, in plan order
                slices.setdefault((i, rank), []).append(flat[offset : offset + count])
    for w in works:
        w.wait()
    out = []
    for i, t in enumerate(plan):
        pieces = [p for p in t.pieces if p.length > 0]
        if len(pieces) == 1:  # the whole tensor from one rank
            out.append((t.name, slices[(i, pieces[0].rank)][0].view(t.shape)))
            continue
        count = 1
        for d in t.shape:
            count *= d
        full = alloc(count, DTYPES[t.dtype], torch.device(device)).view(t.shape)
        for p in pieces:
            view = full.narrow(p.dim, p.start, p.length)
            view.copy_(slices[(i, p.rank)].pop(0).view(view.shape))
        out.append((t.name, full))
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


DTYPES = WIRE_DTYPES


def flat_layout(
    names, dtypes, shapes
) -> tuple[dict[str, int], list[tuple[str, str, list[int], int]]]:
    """Per-dtype flat buffer sizes (elements) and each tensor's (name, dtype, shape, offset)."""
    sizes: dict[str, int] = {}
    layout = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} for {name}")
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"negative dimension in the shape {list(shape)} of {name}")
        count = 1
        for d in shape:
            count *= int(d)
        layout.append((name, dtype, list(shape), sizes.get(dtype, 0)))
        sizes[dtype] = sizes.get(dtype, 0) + count
    return sizes, layout
