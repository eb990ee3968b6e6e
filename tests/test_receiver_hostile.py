"""The engine's group receiver (weights/receiver.py) against hostile pushes: every malformed
broadcast bucket or p2p placement plan is refused before anything is allocated or received,
what an earlier bucket staged is dropped, and the next good push loads exactly its tensors."""

import threading

import pytest
import torch

from miles_core.weights.group import host_store, open_group, send_bucket
from miles_core.weights.receiver import P2P_FORMAT, GroupReceiver, ReceiveRefused


def _plan(name, shape, pieces, dtype="float32"):
    return {"name": name, "shape": shape, "dtype": dtype, "pieces": pieces}


# p2p bodies: (names, plan, senders). The engine is rank 1 of a 2-member group.
HOSTILE_PLANS = {
    "4 TB tensor": (["a"], [_plan("a", [10**6, 10**6], [[0, 0, 0, 10**6]])], 1),
    "overflowing shape": (["a"], [_plan("a", [10**30], [[0, 0, 0, 10**30]])], 1),
    "negative dimension": (["a"], [_plan("a", [4, -3], [[0, 0, 0, 4]])], 1),
    "a tensor named twice": (["b", "b"], [_plan("b", [5], [[0, 0, 0, 5]])] * 2, 1),
    "a piece from the engine's own rank": (["b"], [_plan("b", [5], [[1, 0, 0, 5]])], 2),
    "no senders": ([], [], None),
    "pieces not a list": (["b"], [_plan("b", [5], {"x": 1})], 1),
    "plan entry not an object": (["b"], ["zzz"], 1),
    "a dim the tensor lacks": (["b"], [_plan("b", [5], [[0, 7, 0, 5]])], 1),
    "an unknown dtype": (["b"], [_plan("b", [5], [[0, 0, 0, 5]], "complex64")], 1),
}
# broadcast bodies: (names, dtypes, shapes)
HOSTILE_BUCKETS = {
    "4 TB bucket": (["a"], ["float32"], [[10**6, 10**6]]),
    "negative bucket shape": (["a"], ["float32"], [[-4, 3]]),
    "shapes missing": (["a"], ["float32"], []),
}


@pytest.fixture(scope="module")
def group():
    """A real 2-member gloo group: the 'trainer' (rank 0, `send`) and the receiver (rank 1)."""
    params = {"a": torch.zeros(4, 3), "b": torch.zeros(5)}
    loaded: list[dict[str, torch.Tensor]] = []

    def load(tensors, flush_cache):
        for name, t in tensors:
            params[name].copy_(t)
        loaded.append({n: t.clone() for n, t in tensors})

    receiver = GroupReceiver(lambda: params, load, timeout_s=20)
    store = host_store("127.0.0.1", 2, 20)
    trainer: dict = {}
    joining = threading.Thread(
        target=lambda: trainer.update(pg=open_group("127.0.0.1", store.port, 0, 2, 20)[1])
    )
    joining.start()
    receiver.join("g", "127.0.0.1", store.port, 1, 2, "gloo")
    joining.join()
    yield receiver, trainer["pg"], params, loaded
    receiver.leave("g")


def _push(receiver, pg, bucket, last):
    """A good broadcast bucket: the trainer sends on a thread while the receiver receives."""
    sender = threading.Thread(target=send_bucket, args=(pg, bucket))
    sender.start()
    n = receiver.receive(
        "g",
        [name for name, _ in bucket],
        ["float32"] * len(bucket),
        [list(t.shape) for _, t in bucket],
        last,
    )
    sender.join()
    return n


@pytest.mark.parametrize("case", sorted(HOSTILE_PLANS) + sorted(HOSTILE_BUCKETS))
def test_a_hostile_push_is_refused_and_drops_what_was_staged(group, case):
    receiver, pg, params, loaded = group
    before = {n: t.clone() for n, t in params.items()}
    loads = len(loaded)
    assert _push(receiver, pg, [("b", torch.full((5,), 7.0))], last=False) == 1
    assert receiver.staged("g") == 1
    with pytest.raises(ReceiveRefused):
        if case in HOSTILE_PLANS:
            names, plan, senders = HOSTILE_PLANS[case]
            receiver.receive("g", names, [], [], True, True, P2P_FORMAT, plan, senders)
        else:
            names, dtypes, shapes = HOSTILE_BUCKETS[case]
            receiver.receive("g", names, dtypes, shapes, True)
    assert receiver.staged("g") == 0  # the earlier bucket is gone, not loaded with the next
    assert len(loaded) == loads
    assert all(torch.equal(params[n], before[n]) for n in params)
    # the next good push (one bucket, last) loads exactly its own tensors: no 7s from before
    a, b = torch.randn(4, 3), torch.randn(5)
    assert _push(receiver, pg, [("a", a), ("b", b)], last=True) == 2
    assert torch.equal(params["a"], a) and torch.equal(params["b"], b)
    assert set(loaded[-1]) == {"a", "b"}
