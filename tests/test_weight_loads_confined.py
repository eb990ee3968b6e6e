"""Weight loads confined (issue 14): an engine server maps only its transport's shared-memory
bucket files, reads disk loads only under its `--weight-roots` (bounded, regular files only, off
the event loop with a timeout), joins weight groups only as a receiving rank and never loads a
push with nothing received; and its bad requests are 4xx, never 5xx.

The app is the real engine server's (`create_app`) over a real ServingEngine, called in-process;
stores, HTTP servers and weight groups are real (http.server threads, gloo on loopback)."""

from __future__ import annotations

import copy
import http.server
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from miles_core.engines.cpu.disk_loads import max_load_bytes
from miles_core.engines.cpu.server import create_app
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.weights import weights_checksum
from miles_core.weights.group import host_store, open_group
from miles_core.weights.shm import _MAPPED, PREFIX, ShmBucketWriter, shm_dir, unlink_mapped
from miles_core.weights.source import TensorBuckets
from miles_core.weights.transports.disk import DiskTransport, version_dir


class _Stall(http.server.BaseHTTPRequestHandler):
    """A store that takes every request and answers none until released (or counts them)."""

    hits: list[str] = []
    arrived = threading.Semaphore(0)  # one release per request taken
    release = threading.Event()

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        type(self).arrived.release()
        type(self).release.wait(30)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def store():
    """A real HTTP server on 127.0.0.1 that stalls: an SSRF target, or a slow weight root."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stall)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Stall.release.set()
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLOSED = f"http://127.0.0.1:{_closed_port()}/weights"  # a root whose store cannot be reached


@pytest.fixture(scope="module")
def stack(tiny, tiny_dir, tmp_path_factory, store):
    model, tok = tiny
    engine = ServingEngine(copy.deepcopy(model), tok)
    root = tmp_path_factory.mktemp("roots")
    roots = [str(root), f"{store}/slow", CLOSED]
    app = create_app(engine, str(tiny_dir), roots, load_timeout_s=1.5)
    with TestClient(app, raise_server_exceptions=True) as client:
        yield engine, client, root
    engine.close()


def _weights(engine, delta=0.01):
    return {n: t.clone() + delta for n, t in engine.named_tensors().items()}


def _post(client, path, body):
    """POSTs `body` as JSON (NaN / Infinity written as JavaScript does: a hostile client's)."""
    raw = json.dumps(body)
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, r.status_code, r.text)
    return r


def _state(engine):
    return weights_checksum(engine.named_tensors().items()), engine.weight_version


# ---------------------------------------------------------------------- shared memory
def _description(path, nbytes=256, adopt=True, name="model.norm.weight", count=64):
    tensors = [{"name": name, "dtype": "float32", "shape": [count], "offset": 0}]
    return json.dumps({"path": str(path), "nbytes": nbytes, "adopt": adopt, "tensors": tensors})


def _shm_push(client, descriptions, version=None):
    body = {"serialized_named_tensors": descriptions, "load_format": "shared_memory"}
    if version is not None:
        body["weight_version"] = str(version)
    return _post(client, "/update_weights_from_tensor", body)


def test_a_shared_memory_push_maps_only_this_users_regular_bucket_files(stack, tmp_path):
    """Reproduction: a bucket `path` naming a host file was mapped read-write and adopted."""
    engine, client, _ = stack
    before = _state(engine)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 64)
    shm = shm_dir()
    link = shm / f"{PREFIX}test-link-{os.getpid()}"
    fifo = shm / f"{PREFIX}test-fifo-{os.getpid()}"
    foreign = shm / f"{PREFIX}test-foreign-{os.getpid()}"
    link.symlink_to(victim)
    os.mkfifo(fifo)
    foreign.write_bytes(b"\0" * 256)
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)  # another user's file named like a bucket
    try:
        paths = [victim, link, fifo, shm / f"{PREFIX}missing", f"{PREFIX}relative"]
        for path in paths + ([foreign] if os.getuid() == 0 else []):
            r = _shm_push(client, [_description(path)], version=77)
            assert r.status_code == 400 and "is not a miles-weights-* file" in r.text, path
        assert victim.read_bytes() == b"precious" * 64
        writer = ShmBucketWriter()
        try:  # a real bucket that claims more than this model holds, or a hostile layout
            good = json.loads(writer.write(0, [("model.norm.weight", torch.zeros(64))]))
            huge = dict(good, nbytes=max_load_bytes(engine.named_tensors()) + 1)
            negative = dict(good, tensors=[dict(good["tensors"][0], shape=[-4, 16])])
            for bad in (huge, negative, dict(good, tensors="x"), dict(good, nbytes="1e999")):
                assert _shm_push(client, [json.dumps(bad)], version=77).status_code == 400
            assert _shm_push(client, [], version=77).status_code == 400  # nothing to load
        finally:
            writer.close()
    finally:
        for p in (link, fifo, foreign):
            p.unlink(missing_ok=True)
    assert _state(engine) == before


def test_unlink_mapped_removes_only_the_files_it_mapped(stack):
    """Reproduction: `unlink_mapped` (run when the trainer dies) deleted every mapped path, also
    a file that had since replaced the bucket at that name."""
    engine, client, _ = stack
    writer = ShmBucketWriter()
    kept = None
    try:
        desc = writer.write(0, [("model.norm.weight", engine.named_tensors()["model.norm.weight"])])
        assert _shm_push(client, [desc]).status_code == 200
        path = Path(json.loads(desc)["path"])
        assert any(k[0] == str(path) for k in _MAPPED)
        path.unlink()
        path.write_bytes(b"not the mapped file")  # a new inode at the mapped name
        kept = path
        assert str(path) not in unlink_mapped()
        assert path.read_bytes() == b"not the mapped file"
    finally:
        writer.close()
        if kept is not None:
            kept.unlink(missing_ok=True)


# ---------------------------------------------------------------------- disk loads
def _disk(client, path, version=None):
    body = {"model_path": path}
    if version is not None:
        body["weight_version"] = str(version)
    return _post(client, "/update_weights_from_disk", body)


def _write_push(engine, root, version, weights=None):
    transport = DiskTransport(root=str(root), keep=10)
    transport.connect([])  # write only
    weights = weights or _weights(engine)
    transport.push(TensorBuckets(weights), version=version)
    return version_dir(str(root), version), weights


def test_disk_loads_come_only_from_the_weight_roots(stack, store, tiny):
    """Reproduction: any fsspec URL or relative path was read (SSRF to loopback, ../../etc,
    s3:// credential lookups, /dev/zero until memory ran out)."""
    engine, client, root = stack
    before = _state(engine)
    _Stall.hits.clear()
    outside = [f"{store}/weights", "s3://bucket/weights", "/dev/zero", "/etc/hostname"]
    outside += ["/etc/no-such-file", "file:///etc/hostname", "gs://x/y", str(root) + "-sibling"]
    for path in outside:
        r = _disk(client, path, version=5)
        assert r.status_code == 403, (path, r.text)
        assert (
            r.json()["message"]
            == f"no safetensors weights at {path!r} under this engine's weight roots"
        )
    malformed = [
        "../../etc/hostname",
        "weights",
        f"{root}/../../etc/hostname",
        f"{store}/slow/%2e%2e/x",
    ]
    malformed += [f"simplecache::{store}/slow/x", f"{store}/slow/x?y=1"]
    for path in malformed:
        r = _disk(client, path, version=5)
        assert r.status_code == 400, (path, r.text)
    assert _Stall.hits == []  # nothing outside the roots was fetched
    (root / "escape").symlink_to("/etc")  # a link out of the roots is outside them
    assert _disk(client, f"{root}/escape/hostname").status_code == 403
    # without roots configured, no disk load at all
    model, tok = tiny
    bare = ServingEngine(copy.deepcopy(model), tok)
    try:
        with TestClient(create_app(bare)) as c:
            r = _disk(c, str(root), version=5)
            assert r.status_code == 403 and "--weight-roots" in r.text
    finally:
        bare.close()
    assert _state(engine) == before


def test_disk_loads_read_regular_files_only_and_no_further_than_their_size(stack, monkeypatch):
    """Reproductions: a FIFO blocked a worker forever, /dev/zero was read until memory ran out,
    a non-safetensors file or an unreachable URL was a 500, and an unreadable file (500) told
    itself from a missing one (400)."""
    engine, client, root = stack
    before = _state(engine)
    d = root / "odd"
    d.mkdir()
    os.mkfifo(d / "fifo.safetensors")
    (d / "zero.safetensors").symlink_to("/dev/zero")
    missing = _disk(client, str(d), version=5)  # no regular safetensors file in it
    assert missing.status_code == 403
    assert _disk(client, str(d / "fifo.safetensors")).json()["message"].endswith("weight roots")
    (root / "notes.safetensors").write_text("not safetensors")
    r = _disk(client, str(root / "notes.safetensors"))
    assert r.status_code == 400 and "is not a safetensors file" in r.text
    r = _disk(client, f"{CLOSED}/weight_v000001")  # under a root, but nothing answers there
    assert r.status_code == 400 and "cannot read weights at" in r.text
    with open(root / "big.safetensors", "wb") as f:  # sparse: larger than the model can be
        f.truncate(max_load_bytes(engine.named_tensors()) + 1)
    r = _disk(client, str(root / "big.safetensors"))
    assert r.status_code == 400 and "more than this engine's model can hold" in r.text
    # a push whose file grew past the manifest's size is refused before it is read
    path, _ = _write_push(engine, root, 61)
    with open(Path(path) / "model.safetensors", "ab") as f:
        f.write(b"\0" * 4096)
    r = _disk(client, path, version=61)
    assert r.status_code == 400 and "the manifest says" in r.text
    # an existing file that cannot be read answers as a missing one does
    path, _ = _write_push(engine, root, 62)
    real_open = os.open

    def unreadable(p, flags, *args):
        if str(p).endswith("weight_v000062/model.safetensors"):
            raise PermissionError(13, "Permission denied", p)
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", unreadable)
    denied = _disk(client, path, version=62)
    monkeypatch.undo()
    gone_path = path.replace("weight_v000062", "weight_v000063")
    gone = _disk(client, gone_path, version=62)
    assert denied.status_code == gone.status_code == 403
    assert denied.json()["message"].replace(path, "P") == gone.json()["message"].replace(
        gone_path, "P"
    )
    assert _state(engine) == before


def test_a_disk_push_under_a_root_loads_bitwise_with_its_version(stack):
    engine, client, root = stack
    path, weights = _write_push(engine, root, 70)
    assert _disk(client, path, version=70).status_code == 200
    assert _state(engine) == (weights_checksum(weights.items()), 70)


def test_stalled_disk_loads_time_out_and_never_hold_up_control_routes(stack, store):
    """Reproduction: six concurrent loads of a FIFO exhausted the default executor; pause,
    abort and flush then hung while /health answered, and the queued pause later left the
    engine paused. Here the loads stall on a real slow store under a root."""
    engine, client, _ = stack
    before = _state(engine)
    _Stall.release.clear()
    _Stall.arrived = threading.Semaphore(0)
    answers: list = []

    def load(i):
        answers.append(_disk(client, f"{store}/slow/v{i}", version=9))

    loads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in loads:
        t.start()
    # both of the loader's threads are stalled on the store
    assert _Stall.arrived.acquire(timeout=10) and _Stall.arrived.acquire(timeout=10)
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache"):
        assert client.post(path, json={}).status_code == 200, path
    assert client.get("/health").status_code == 200
    # all answered while the stalled loads still held their threads (before their 408)
    assert [r.status_code for r in answers if r.status_code != 429] == []
    for t in loads:
        t.join(10)
    _Stall.release.set()
    codes = sorted(r.status_code for r in answers)
    assert codes == [408, 408, 429, 429, 429, 429], [r.text for r in answers]
    assert engine.paused is None and _state(engine) == before


# ---------------------------------------------------------------------- weight groups
def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.add(address)
    return found


def test_the_rendezvous_listens_on_the_address_it_was_given():
    """Reproduction: the weight group's TCPStore listened on every interface."""
    store = host_store("127.0.0.1", 1, timeout_s=5)
    assert _listeners(store.port) == {"0100007F"}  # 127.0.0.1 only: no 0.0.0.0, no ::
    del store


def test_a_group_push_with_nothing_received_is_refused_and_keeps_the_version(stack):
    """Reproduction: joining as rank 0 of a 1-member group, then an update with no sender,
    loaded uninitialised memory as weights (200, new version); so did an empty last bucket."""
    engine, client, _ = stack
    before = _state(engine)
    lone = host_store("127.0.0.1", 1, timeout_s=5)
    r = _post(
        client,
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": lone.port, "rank_offset": 0,
         "world_size": 1, "group_name": "lone"},
    )  # fmt: skip
    assert r.status_code == 400 and "rank_offset 0" in r.text
    wild = {"master_address": "0.0.0.0", "master_port": lone.port, "rank_offset": 1,
            "world_size": 2, "group_name": "wild"}  # fmt: skip
    assert _post(client, "/init_weights_update_group", wild).status_code == 400
    # found by tests/test_fuzz.py: an address that does not resolve, or a port where nothing
    # listens, held the request for the whole rendezvous timeout (120 s); now a 400 at once
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    for host, port in (("nil", 1024), ("127.0.0.1", free)):
        t0 = time.monotonic()
        nowhere = {"master_address": host, "master_port": port, "rank_offset": 1,
                   "world_size": 2, "group_name": "nowhere"}  # fmt: skip
        r = _post(client, "/init_weights_update_group", nowhere)
        assert r.status_code == 400 and "no weight-group rendezvous answers" in r.text, r.text
        assert time.monotonic() - t0 < 10
    store = host_store("127.0.0.1", 2, timeout_s=20)
    trainer: dict = {}
    joining = threading.Thread(
        target=lambda: trainer.update(pg=open_group("127.0.0.1", store.port, 0, 2, 20)[1])
    )
    joining.start()
    body = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1,
            "world_size": 2, "group_name": "g"}  # fmt: skip
    assert _post(client, "/init_weights_update_group", body).status_code == 200
    joining.join()
    try:
        empty = {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "weight_version": "8"}
        r = _post(client, "/update_weights_from_distributed", empty)
        assert r.status_code == 400 and "nothing was received" in r.text
        plan = [{"name": "model.norm.weight", "shape": [float("inf")], "dtype": "float32",
                 "pieces": [[0, 0, 0, 64]]}]  # fmt: skip
        for load_format, extra in (("p2p_shards/2", {}), ("p2p_shards", {"plan": plan}),
                                   ("p2p_shards", {"plan": [[1, 2]]})):  # fmt: skip
            bad = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                   "group_name": "g", "weight_version": "8", "load_format": load_format,
                   "senders": 1, **extra}  # fmt: skip
            assert _post(client, "/update_weights_from_distributed", bad).status_code == 400
    finally:
        _post(client, "/destroy_weights_update_group", {"group_name": "g"})
    assert _state(engine) == before


# ---------------------------------------------------------------------- 5xx that were due a 4xx
def test_seeds_out_of_range_and_a_released_kv_cache_are_4xx(stack, tiny):
    """Reproductions: sampling_seed >= 2**64 was a 500; /generate after releasing only the KV
    cache answered 200 with an IndexError inside."""
    engine, client, _ = stack
    _, tok = tiny
    ids = tok.encode("say a", add_special_tokens=False)
    for seed in (1 << 64, -(1 << 63) - 1):  # torch takes [-2**63, 2**64)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}}
        r = _post(client, "/generate", body)
        assert r.status_code == 400 and "sampling_seed" in r.text
    assert _post(client, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    try:
        r = _post(client, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "KV cache is released" in r.text
    finally:
        assert _post(client, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    r = _post(client, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"
