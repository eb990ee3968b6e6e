"""A standalone process group between a trainer's sending ranks and engine processes, apart
from any default group (the trainer's ranks keep theirs): a TCPStore rendezvous hosted in the
trainer's process (bound to port 0, or within a range, and the port it got passed on: no
choose-then-bind race), then a process group bound to it: gloo for CPU tensors, nccl for CUDA
tensors (`miles_core.device.dist_backend(device)`). SGLang's `/init_weights_update_group` builds the same thing.

Both halves of the wire format live here: a bucket flattened per dtype and broadcast
(`send_bucket` / `receive_bucket`), and p2p shards assembled from a placement plan
(`receive_shards`; the trainer's half is its backend's `send_shards`)."""

from __future__ import annotations

import datetime
import os
import socket

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from miles_core.weights.source import TensorPlan

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
    works = [pg.broadcast(chunk, 0) for chunk in flat.chunk(STREAMS)]
    for w in works:
        w.wait()


def send_bucket(pg: ProcessGroupGloo, bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Rank 0's half of a bucket: one flat broadcast per dtype (sorted), tensors in bucket
    order. Returns the bytes sent."""
    sent = 0
    for dtype in sorted({_name(t.dtype) for _, t in bucket}):
        flat = torch.cat([t.detach().reshape(-1) for _, t in bucket if _name(t.dtype) == dtype])
        broadcast(pg, flat)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_bucket(
    pg, names, dtypes, shapes, device: str | torch.device = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """An engine's half of `send_bucket`: views into the received flat buffers (on `device`)."""
    sizes, layout = flat_layout(names, dtypes, shapes)
    flats = {}
    for dtype in sorted(sizes):
        flats[dtype] = torch.empty(sizes[dtype], dtype=DTYPES[dtype], device=device)
        broadcast(pg, flats[dtype])
    out = []
    for name, dtype, shape, offset in layout:
        count = 1
        for d in shape:
            count *= d
        out.append((name, flats[dtype][offset : offset + count].view(shape)))
    return out


def receive_shards(
    pg, plan: list[TensorPlan], device: str | torch.device = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """An engine's half of p2p: each tensor assembled from the pieces its plan names, received
    from their trainer ranks (tagged with the tensor's index in the plan)."""
    for t in plan:
        if t.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {t.dtype!r} for {t.name}")
    out = []
    for tag, t in enumerate(plan):
        full = torch.empty(t.shape, dtype=DTYPES[t.dtype], device=device)
        for p in t.pieces:
            if p.length == 0:
                continue
            view = full.narrow(p.dim, p.start, p.length) if t.shape else full.view(1)
            into = view if view.is_contiguous() else torch.empty_like(view)
            pg.recv([into], p.rank, tag).wait()
            if into is not view:
                view.copy_(into)
        out.append((t.name, full))
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
}


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
