"""Optimizer-state offload (`train.offload.optimizer`): AdamW's state kept in host memory or in
bucket files between steps is bitwise the resident optimizer's at every step, survives a
checkpoint, and bad settings are refused at config time."""

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from miles_core.config import load_config
from miles_core.config.offload import OffloadSettings
from miles_core.train.lr_schedule import build_optimizer
from miles_core.train.optimizer_offload import KEYS, OffloadedAdamW, materialized
from tests.test_backends import _sft_batch, _trainer

OPTIM = {
    "lr": 1e-2,
    "min_lr": 0.0,
    "lr_warmup_steps": 2,
    "lr_decay_style": "cosine",
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "weight_decay": 0.1,
}


def _module(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)
    )


def _states(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    with materialized(optimizer):
        return {
            i: {k: optimizer.state[p][k].clone() for k in KEYS}
            for i, p in enumerate(optimizer.param_groups[0]["params"])
            if optimizer.state[p]
        }


def _assert_same(a_model, a_opt, b_model, b_opt):
    for pa, pb in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    sa, sb = _states(a_opt), _states(b_opt)
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for k in KEYS:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    if step == 2:  # a parameter without a gradient this step: AdamW leaves it and its state
        model[0].bias.grad = None
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_streamed_state_is_bitwise_the_resident_state_at_every_step(mode, tmp_path):
    resident, streamed = _module(), _module()
    opt_r, sched_r = build_optimizer(resident.parameters(), OPTIM, total_steps=8)
    # 4096 B buckets: the 64×64 weight is a bucket of its own, the rest share a few
    offload = {"optimizer": mode, "bucket_mb": 4096 / (1 << 20)}
    if mode == "disk":
        offload["dir"] = str(tmp_path)
    opt_s, sched_s = build_optimizer(streamed.parameters(), OPTIM | {"offload": offload}, 8)
    assert isinstance(opt_s, OffloadedAdamW) and len(opt_s._buckets()) >= 3
    for step in range(6):
        for model, opt, sched in ((resident, opt_r, sched_r), (streamed, opt_s, sched_s)):
            _grads(model, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        assert not opt_s.state  # between steps no state is held by the optimizer itself
        _assert_same(resident, opt_r, streamed, opt_s)
    if mode == "disk":
        files = list(tmp_path.rglob("bucket-*.safetensors"))
        assert len(files) == len(opt_s._buckets()) and opt_s.resident_state_bytes() == 0
    else:
        assert opt_s.resident_state_bytes() == sum(p.numel() * 8 + 4 for p in streamed.parameters())


def test_a_checkpointed_streamed_optimizer_resumes_bitwise(tmp_path):
    resident, streamed = _module(), _module()
    opt_r, sched_r = build_optimizer(resident.parameters(), OPTIM, total_steps=8)
    settings = OPTIM | {"offload": {"optimizer": "disk", "dir": str(tmp_path), "bucket_mb": 0.01}}
    opt_s, sched_s = build_optimizer(streamed.parameters(), settings, 8)
    for step in range(3):
        for model, opt, sched in ((resident, opt_r, sched_r), (streamed, opt_s, sched_s)):
            _grads(model, step)
            opt.step()
            sched.step()
    saved = opt_s.state_dict()  # as a checkpoint reads it: the full state
    assert len(saved["state"]) == 6
    again = _module()
    again.load_state_dict(streamed.state_dict())
    opt_a, sched_a = build_optimizer(again.parameters(), settings, 8)
    opt_a.load_state_dict(saved)
    sched_a.load_state_dict(sched_s.state_dict())
    assert not opt_a.state
    for step in range(3, 6):
        for model, opt, sched in ((resident, opt_r, sched_r), (again, opt_a, sched_a)):
            _grads(model, step)
            opt.step()
            sched.step()
        _assert_same(resident, opt_r, again, opt_a)


def test_sharded_parameters_keep_their_layout_through_the_store(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        base = torch.randn(8, 4)
        pr = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        ps = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        opt_r, _ = build_optimizer([pr], OPTIM, 4)
        offload = {"optimizer": "disk", "dir": str(tmp_path)}
        opt_s, _ = build_optimizer([ps], OPTIM | {"offload": offload}, 4)
        for step in range(3):
            g = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            for p, opt in ((pr, opt_r), (ps, opt_s)):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                opt.step()
        assert torch.equal(pr.full_tensor(), ps.full_tensor())
        with materialized(opt_s):
            moment = opt_s.state[ps]["exp_avg"]
            assert isinstance(moment, DTensor) and moment.placements == (Shard(0),)
            assert torch.equal(moment.full_tensor(), opt_r.state[pr]["exp_avg"].full_tensor())
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "backend, mode",
    [("fsdp", "disk"), pytest.param("megatron", "disk", marks=pytest.mark.slow)],
)
def test_a_trainer_trains_and_resumes_bitwise_with_offloaded_state(
    backend, mode, tiny_dir, tiny, tmp_path
):
    _, tok = tiny
    batch = _sft_batch(tok)
    state_dir = str(tmp_path / "state") if mode == "disk" else None
    offload = OffloadSettings(optimizer=mode, bucket_mb=0.25, dir=state_dir)
    resident = _trainer(tiny_dir, backend, lr=1e-2)
    streamed = _trainer(tiny_dir, backend, lr=1e-2, offload=offload)
    assert len(streamed.optimizer._buckets()) > 1
    for _ in range(2):
        for trainer in (resident, streamed):
            trainer.train_step(batch, loss="sft")
        _assert_same(resident.model, resident.optimizer, streamed.model, streamed.optimizer)
    streamed.save(str(tmp_path / "ckpt"))
    again = _trainer(tiny_dir, backend, lr=1e-2, offload=offload)
    again.load(str(tmp_path / "ckpt"))
    for trainer in (resident, again):
        trainer.train_step(batch, loss="sft")
    _assert_same(resident.model, resident.optimizer, again.model, again.optimizer)


def test_offload_settings_are_checked_at_config_time():
    config = load_config(None, ["train.offload.optimizer=disk", "train.offload.dir=/tmp/x"])
    assert config.train.offload.optimizer == "disk"
    with pytest.raises(ValidationError, match="offload.dir is for optimizer: disk"):
        load_config(None, ["train.offload.dir=/tmp/x"])
    with pytest.raises(ValidationError, match="train.offload.optimizer"):
        load_config(None, ["train.offload.optimizer=nvme"])
