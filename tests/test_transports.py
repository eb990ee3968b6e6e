"""Weight transports to a real engine server subprocess: bitwise equality after every push,
versions, and bad pushes that change nothing."""

import json

import pytest
import torch

from miles_core.engines.http import EngineRequestRejected, HttpEngine
from miles_core.models import load_hf_dir
from miles_core.weights import TRANSPORTS, weights_checksum
from miles_core.weights.group import open_group, send_pieces
from miles_core.weights.remote import PushFailed
from miles_core.weights.shm import ShmBucketWriter
from miles_core.weights.source import Placement, TensorBuckets, TensorPlan, dim_chunks, dtype_name
from miles_core.weights.transports.disk import DiskTransport, version_dir
from tests.rank_threads import local_rows, on_ranks, row_plan
from tests.servers import engine_client


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    with engine_client(tiny_dir, ["--threads", "1"], tmp_path_factory) as client:
        yield client


def _new_weights(tiny_dir, seed):
    model, _ = load_hf_dir(tiny_dir)
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        for n, p in model.named_parameters()
    }


def _buckets(weights, per=5):
    return TensorBuckets(weights, per=per)


@pytest.mark.parametrize("name", ["shared_memory", "disk", "broadcast"])
def test_push_is_bitwise_and_sets_the_version(server, tiny_dir, tmp_path, name):
    transport = (
        DiskTransport(root=str(tmp_path / "w"), keep=1)
        if name == "disk"
        else TRANSPORTS.get(name)()
    )
    transport.connect([server])
    # three pushes: shared memory alternates its two file sets (the engine adopts one while the
    # trainer writes the other), disk writes a directory per version and keeps the newest
    for version, seed in ((11, 1), (12, 2), (13, 3)):
        weights = _new_weights(tiny_dir, seed)
        stats = transport.push(_buckets(weights), version=version, pause_mode="retract")
        assert server.weights_checksum() == weights_checksum(weights.items())
        assert server.weight_version == version
        assert stats.bytes > 0 and stats.gbps > 0
    if name == "disk":
        assert not (tmp_path / "w" / "weight_v000012").exists()  # keeps the newest `keep`
    getattr(transport, "close", lambda: None)()


@pytest.mark.parametrize("name", ["shared_memory", "disk", "broadcast"])
def test_bf16_pushes_into_an_fp32_engine_are_exact_at_half_the_bytes(
    server, tiny_dir, tmp_path, name
):
    disk = name == "disk"
    transport = (
        DiskTransport(root=str(tmp_path / "w"), keep=3, delta=True)
        if disk
        else TRANSPORTS.get(name)()
    )
    transport.connect([server])
    weights = _new_weights(tiny_dir, 4)
    full = transport.push(_buckets(weights), version=21).bytes
    for version in (22, 23):  # the second bf16 push changes a few tensors only
        if version == 23:
            for n in sorted(weights)[:3]:
                weights[n] = weights[n] + 0.05
        half = {n: t.to(torch.bfloat16) for n, t in weights.items()}
        stats = transport.push(_buckets(half), version=version)
        assert server.weights_checksum() == weights_checksum(
            (n, t.float()) for n, t in half.items()
        )
        assert server.weight_version == version
        if not disk:
            assert stats.bytes == full // 2
    if disk:  # fp32 -> bf16 is a full push; the next bf16 push is a delta of 3 tensors
        kinds = [
            json.loads((tmp_path / "w" / f"weight_v0000{v}" / "manifest.json").read_text())
            for v in (22, 23)
        ]
        assert kinds[0]["kind"] == "full" and kinds[1]["kind"] == "delta"
        assert len(kinds[1]["encoded"]) == 3
    getattr(transport, "close", lambda: None)()


def test_a_corrupt_or_foreign_disk_push_is_refused_and_changes_nothing(server, tiny_dir, tmp_path):
    transport = DiskTransport(root=str(tmp_path / "w"))
    transport.connect([server])
    transport.push(_buckets(_new_weights(tiny_dir, 3)), version=20)
    before = server.weights_checksum()
    path = version_dir(str(tmp_path / "w"), 20)
    blob = bytearray((tmp_path / "w" / "weight_v000020" / "model.safetensors").read_bytes())
    blob[-3] ^= 0xFF  # flip bits inside the last tensor's data
    (tmp_path / "w" / "weight_v000020" / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(EngineRequestRejected, match="checksum mismatch"):
        server.update_weights_from_disk(path, version=21)
    manifest = tmp_path / "w" / "weight_v000020" / "manifest.json"
    spec = json.loads(manifest.read_text())
    spec["tensors"]["model.extra.weight"] = "0" * 64
    manifest.write_text(json.dumps(spec))
    with pytest.raises(EngineRequestRejected, match="do not match the manifest"):
        server.update_weights_from_disk(path, version=21)
    assert server.weights_checksum() == before and server.weight_version == 20


def test_a_shared_memory_bucket_that_does_not_fit_is_refused_and_changes_nothing(server):
    before, version = server.weights_checksum(), server.weight_version
    writer = ShmBucketWriter()
    try:
        good = writer.write(0, [("model.norm.weight", torch.zeros(64))])
        bad = writer.write(1, [("model.nope.weight", torch.zeros(3))])
        with pytest.raises(EngineRequestRejected, match="do not fit this model"):
            server.update_weights_from_shared_memory([good, bad], version=99)
        with pytest.raises(EngineRequestRejected, match="load_format"):
            server.post("/update_weights_from_tensor", {"serialized_named_tensors": [good]})
    finally:
        writer.close()
    assert server.weights_checksum() == before and server.weight_version == version


@pytest.mark.parametrize("name", ["shared_memory", "disk", "broadcast"])
def test_an_unreachable_engine_fails_the_push_before_any_engine_loads(
    server, tiny_dir, tmp_path, name
):
    dead = HttpEngine("http://127.0.0.1:9")  # nothing listens on the discard port
    transport = (
        DiskTransport(root=str(tmp_path / "w")) if name == "disk" else TRANSPORTS.get(name)()
    )
    before, version = server.weights_checksum(), server.weight_version
    if name == "broadcast":  # the group is formed at connect: that is where it fails
        with pytest.raises(PushFailed, match="127.0.0.1:9 cannot be reached"):
            transport.connect([server, dead])
        assert server.weights_checksum() == before and server.weight_version == version
        return
    transport.connect([server, dead])
    with pytest.raises(PushFailed, match="127.0.0.1:9 cannot be reached"):
        transport.push(_buckets(_new_weights(tiny_dir, 5)), version=version + 1)
    assert server.weights_checksum() == before and server.weight_version == version
    assert server.server_info()["paused"] is None  # the live engine was continued
    transport.connect([server])  # later pushes work; shared memory moved to fresh files, so
    for seed in (6, 7, 8):  # no file an engine may still serve from is ever written again
        weights = _new_weights(tiny_dir, seed)
        transport.push(_buckets(weights), version=version + seed)
        assert server.weights_checksum() == weights_checksum(weights.items())


def test_transports_for_servers_refuse_in_process_engines(tiny):
    from miles_core.engines.cpu.embedded import EmbeddedEngine

    model, tok = tiny
    with pytest.raises(ValueError, match="use transport 'colocated'"):
        TRANSPORTS.get("shared_memory")().connect([EmbeddedEngine(model, tok)])


def test_disk_deltas_carry_only_changed_tensors_and_are_refused_out_of_order_or_corrupt(
    server, tiny_dir, tmp_path
):
    root = tmp_path / "d"
    transport = DiskTransport(root=str(root), keep=5, delta=True)
    transport.connect([server])
    weights = _new_weights(tiny_dir, 7)
    full = transport.push(_buckets(weights), version=30).bytes
    assert json.loads((root / "weight_v000030" / "manifest.json").read_text())["kind"] == "full"
    for version in (31, 32):  # small updates of half the tensors
        for i, name in enumerate(sorted(weights)):
            if i % 2 == version % 2:
                weights[name] = weights[name] + 1e-5 * torch.ones_like(weights[name])
        stats = transport.push(_buckets(weights), version=version)
        assert server.weights_checksum() == weights_checksum(weights.items())
        spec = json.loads((root / f"weight_v{version:06d}" / "manifest.json").read_text())
        assert spec["kind"] == "delta" and spec["base_version"] == version - 1
        assert 0 < len(spec["encoded"]) < len(weights)
        assert stats.bytes < full
    name = sorted(weights)[0]  # a change only in the sign of a zero is a change of bytes
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = 0.0
    transport.push(_buckets(weights), version=40)
    weights[name].view(-1)[0] = -0.0
    transport.push(_buckets(weights), version=41)
    assert server.weights_checksum() == weights_checksum(weights.items())
    before = server.weights_checksum()
    with pytest.raises(EngineRequestRejected, match="delta from version 40"):
        server.update_weights_from_disk(str(root / "weight_v000041"), version=42)  # engine at 41
    transport.engines = []  # write delta v33 without loading it, then corrupt one byte
    transport.push(_buckets({n: t + 1e-3 for n, t in weights.items()}), version=42)
    blob = bytearray((root / "weight_v000042" / "model.safetensors").read_bytes())
    blob[-5] ^= 0x01
    (root / "weight_v000042" / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(EngineRequestRejected, match="corrupt|checksum mismatch"):
        server.update_weights_from_disk(str(root / "weight_v000042"), version=42)
    assert server.weights_checksum() == before and server.weight_version == 41


def test_a_broadcast_refused_mid_push_leaves_nothing_staged_for_the_next(server, tiny_dir):
    """A push whose second bucket the engine refuses (a name it lacks) fails after the first
    bucket was received; the next push loads exactly its own tensors, not a mix with the
    first bucket of the failed one."""
    transport = TRANSPORTS.get("broadcast")()
    transport.connect([server])
    try:
        base = _new_weights(tiny_dir, 11)
        transport.push(_buckets(base), version=50)
        assert server.weights_checksum() == weights_checksum(base.items())
        names = sorted(base)
        first = names[:3]  # staged by the failed push, and left out of the next one
        failed = {n: base[n] + 1.0 for n in first}
        bad = [[(n, failed[n]) for n in first], [("model.nope.weight", torch.zeros(4))]]
        with pytest.raises(PushFailed, match="no parameter named 'model.nope.weight'"):
            transport.push(TensorBuckets(bad), version=51)
        assert server.weights_checksum() == weights_checksum(base.items())
        assert server.weight_version == 50
        new = _new_weights(tiny_dir, 12)
        partial = {n: t for n, t in new.items() if n not in first}
        transport.push(_buckets(partial), version=52)
        expected = {**base, **partial}  # the first three keep version 50's values
        assert server.weights_checksum() == weights_checksum(expected.items())
        assert server.weight_version == 52
    finally:
        transport.close()


class _TwoRankShards:
    """A trainer of two ranks (threads of this process) that shards every matrix along dim 1
    and every vector along dim 0: the engine must assemble tensors from the plan it is sent,
    not from an implicit dim-0 chunking."""

    world = 2

    def __init__(self, weights):
        self.weights = weights
        self.groups = [None, None]

    def shard_plan(self, dtype=None):
        plan = []
        for name, t in self.weights.items():
            dim = 1 if t.dim() > 1 else 0
            pieces = [
                Placement(r, dim, start, length)
                for r, (start, length) in enumerate(dim_chunks(t.shape[dim], self.world))
            ]
            plan.append(TensorPlan(name, list(t.shape), dtype_name(t.dtype), pieces))
        return plan

    def _both(self, fn):
        return on_ranks(self.world, lambda rank, _: fn(rank))

    def join_group(self, group):
        def join(rank):
            self.groups[rank] = open_group(
                group["host"], group["port"], rank, group["world"], 60, group["backend"]
            )

        self._both(join)

    def send_shards(self, engine_ranks, dtype=None):
        plan = self.shard_plan(dtype)

        def send(rank):  # the wire's own sender half, as a backend's send_shards calls it
            pieces = {
                i: self.weights[t.name].narrow(p.dim, p.start, p.length)
                for i, t in enumerate(plan)
                for p in t.pieces
                if p.rank == rank and p.length > 0
            }
            return send_pieces(self.groups[rank][1], plan, rank, pieces, engine_ranks)

        return self._both(send)[0]


def test_p2p_assembles_each_tensor_from_the_placement_plan(server, tiny_dir):
    transport = TRANSPORTS.get("p2p")()
    transport.connect([server])
    try:
        with pytest.raises(TypeError, match="p2p needs a trainer backend"):
            transport.push(_buckets(_new_weights(tiny_dir, 13)), version=60)
        trainer = _TwoRankShards({})
        for version, seed in ((61, 14), (62, 15)):  # the group is formed once, then reused
            weights = trainer.weights = _new_weights(tiny_dir, seed)
            stats = transport.push(trainer, version=version)
            assert server.weights_checksum() == weights_checksum(weights.items())
            assert server.weight_version == version and stats.bytes > 0
    finally:
        transport.close()


def test_a_transport_refuses_an_engine_without_its_weight_route(tiny):
    from miles_core.engines.cpu.embedded import EmbeddedEngine
    from miles_core.engines.sglang import SGLANG_ROUTES

    sglang_like = HttpEngine("http://127.0.0.1:9", weight_routes=SGLANG_ROUTES)
    with pytest.raises(
        ValueError,
        match=r"take weights by 'shared_memory'; engine http://127.0.0.1:9 takes \['disk',",
    ):
        TRANSPORTS.get("shared_memory")().connect([sglang_like])
    TRANSPORTS.get("disk")().connect([sglang_like])  # a route SGLang takes: accepted
    model, tok = tiny
    with pytest.raises(ValueError, match="'colocated' needs engines that take weights by 'tensor'"):
        TRANSPORTS.get("colocated")().connect([sglang_like])
    TRANSPORTS.get("colocated")().connect([EmbeddedEngine(model, tok)])
    sglang_like.close()


def test_one_call_pushes_continue_the_engine_and_a_wire_probe_loads_nothing(server, tiny_dir):
    """To our engine server a push is one call that pauses and continues the engine itself,
    also when the push is refused; a wire probe (benchmarks' raw rows) receives the bytes and
    changes neither weights nor version, and is refused with a version."""
    from miles_core.weights.group import broadcast
    from miles_core.weights.receiver import PROBE_FORMAT

    shm = TRANSPORTS.get("shared_memory")()
    shm.connect([server])
    weights = _new_weights(tiny_dir, 21)
    shm.push(_buckets(weights), version=70, pause_mode="retract")
    assert server.server_info()["paused"] is None
    with pytest.raises(EngineRequestRejected, match="do not fit"):
        shm.push(TensorBuckets([[("model.nope.weight", torch.zeros(3))]]), version=71)
    assert server.server_info()["paused"] is None and server.weight_version == 70
    shm.close()
    transport = TRANSPORTS.get("broadcast")()
    transport.connect([server])
    try:
        bucket = [(n, torch.full_like(t, 7.0)) for n, t in weights.items()]
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": transport.group_name,
            "load_format": PROBE_FORMAT,
        }
        with pytest.raises(EngineRequestRejected, match="loads nothing"):
            server.post("/update_weights_from_distributed", {**body, "weight_version": "72"})
        call = transport._pool.submit(server.post, "/update_weights_from_distributed", body)
        broadcast(transport.group[1], torch.zeros(1))
        broadcast(transport.group[1], torch.cat([t.reshape(-1) for _, t in bucket]))
        assert call.result(timeout=60)["message"] == "staged 0 tensors"
        assert server.weights_checksum() == weights_checksum(weights.items())
        assert server.weight_version == 70
    finally:
        transport.close()


NVFP4 = {"format": "nvfp4", "options": {}, "keep_bf16": {"modules": ["lm_head", "router"]}}


@pytest.fixture(scope="module")
def nvfp4_server(tiny_dir, tmp_path_factory):
    """An engine server holding its linear weights in NVFP4 (rollout.precision)."""
    args = ["--threads", "1", "--precision", json.dumps(NVFP4)]
    with engine_client(tiny_dir, args, tmp_path_factory) as client:
        yield client


@pytest.mark.parametrize("name", ["shared_memory", "disk", "broadcast"])
def test_quantized_pushes_land_as_the_trainers_bytes(nvfp4_server, tiny_dir, tmp_path, name):
    """Each transport carries the quantized parts (gate/up pairs split across buckets); the
    engine's bytes are the plan's, and its parameters their dequantized values (the server's
    checksum checks that itself)."""
    from miles_core.precision.plan import QuantPlan
    from miles_core.precision.push import QuantizedSource

    plan = QuantPlan.from_spec(NVFP4, 2)
    transport = (
        DiskTransport(root=str(tmp_path / "w"), keep=1)
        if name == "disk"
        else TRANSPORTS.get(name)()
    )
    transport.connect([nvfp4_server])
    for version, seed in ((21, 4), (22, 5)):
        weights = _new_weights(tiny_dir, seed)
        source = QuantizedSource(_buckets(weights, per=3), plan)
        transport.push(source, version=version, pause_mode="retract")
        expected = plan.export(weights.items())
        assert source.part_names and source.part_names < set(expected)
        assert nvfp4_server.weights_checksum() == weights_checksum(expected.items())
        assert nvfp4_server.weight_version == version
    getattr(transport, "close", lambda: None)()


class _TwoRankRows(_TwoRankShards):
    """FSDP2's layout (rows split over two thread ranks), each rank quantizing its own rows
    for a p2p push (precision/shards.py), the whole-weight statistics max-reduced."""

    def __init__(self, weights, plan):
        super().__init__(weights)
        self.plan = plan

    def shard_plan(self, dtype=None, precision=None):
        from miles_core.precision.shards import quantized_shards

        return quantized_shards(self.plan, row_plan(self.weights, self.world))[0]

    def send_shards(self, engine_ranks, dtype=None, precision=None):
        from miles_core.precision.shards import quantized_shards

        floats = row_plan(self.weights, self.world)

        def send(rank, reduce):
            local = local_rows(self.weights, floats, rank)
            plan, pieces = quantized_shards(self.plan, floats, local, rank, reduce)
            return send_pieces(self.groups[rank][1], plan, rank, pieces, engine_ranks)

        return on_ranks(self.world, send)[0]


def test_a_quantized_p2p_push_lands_as_the_whole_weights_bytes(nvfp4_server, tiny_dir):
    """p2p with rollout.precision: no rank gathers; the engine assembles the parts (NVFP4's
    global amax reduced over the ranks, gate and up sharing it) into the plan's bytes."""
    from miles_core.precision.plan import QuantPlan
    from miles_core.precision.push import QuantizedSource

    plan = QuantPlan.from_spec(NVFP4, 2)
    transport = TRANSPORTS.get("p2p")()
    transport.connect([nvfp4_server])
    weights = _new_weights(tiny_dir, 6)
    transport.push(QuantizedSource(_TwoRankRows(weights, plan), plan), 31, "retract")
    assert nvfp4_server.weights_checksum() == weights_checksum(plan.export(weights.items()).items())
    assert nvfp4_server.weight_version == 31
    transport.close()
