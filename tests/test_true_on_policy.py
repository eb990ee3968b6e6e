"""True on-policy: each invariant kernel gives a row the same bits alone and inside any batch, a
decode over t keys equals row t of the full forward, the model's engine-side and trainer-side
forwards agree bitwise, and a run logs a train/rollout log-prob gap of exactly 0 at every step
(and a non-zero one without the mode: the metric is measured, not assumed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_core.config import load_config
from miles_core.engines.cpu.kv_cache import SlotKVCache
from miles_core.models import build_model, save_hf_dir
from miles_core.models.family import MODEL_FAMILIES
from miles_core.run import runtime
from miles_core.run.preflight import preflight
from miles_core.true_on_policy import ops
from miles_core.true_on_policy.contract import TRUE_ON_POLICY

F32_EPS = torch.finfo(torch.float32).eps


def _rows(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "m, k, n", [(1, 16, 8), (7, 16, 40), (300, 64, 192), (700, 100, 37), (64, 1536, 512)]
)
def test_dot_gives_each_row_the_same_bits_alone_and_in_any_batch(m, k, n):
    """Alone, as a misaligned view, in another batch and under another thread count."""
    x, w = _rows(m, k), _rows(n, k, seed=1)
    full = ops.dot(x, w)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for i in sorted({0, m // 2, m - 1}):
                assert torch.equal(ops.dot(x[i : i + 1], w), full[i : i + 1])
            assert torch.equal(ops.dot(x[m // 3 :], w), full[m // 3 :])
            assert torch.equal(ops.dot(x[m // 3 :].clone(), w), full[m // 3 :])
    finally:
        torch.set_num_threads(threads)
    # the same products summed: within K·eps of the GEMM
    assert torch.allclose(full, x @ w.T, rtol=0, atol=k * F32_EPS * (x.abs() @ w.abs().T).max())
    r = min(m, 8)
    q, keys = _rows(6 * r, k).view(2, 3, r, k), _rows(6 * n, k, seed=2).view(2, 3, n, k)
    batched = ops.dot(q, keys)  # attention's form: each row of q against its own keys
    assert torch.equal(ops.dot(q[:, :, -1:], keys), batched[:, :, -1:])


def test_elementwise_kernels_give_an_element_the_same_bits_wherever_it_sits():
    x = _rows(1, 100_003)[0] * 20
    for fn, ref in [(ops.exp, torch.exp), (ops.silu, F.silu)]:
        whole = fn(x)
        for part in (slice(5, 17), slice(-3, None), slice(40_000, 70_001)):
            assert torch.equal(fn(x[part]), whole[part])
        near = x.abs() < 80  # within range of float32 normals
        assert torch.allclose(whole[near], ref(x[near]), rtol=4 * F32_EPS, atol=0)
    logits = _rows(513, 301) * 5
    lsm = ops.log_softmax(logits)
    assert torch.equal(ops.log_softmax(logits[7:8]), lsm[7:8])
    assert torch.allclose(lsm, torch.log_softmax(logits, -1), rtol=0, atol=301 * F32_EPS * 10)


def test_attention_decoding_over_t_keys_equals_row_t_of_the_full_forward():
    b, h, t, hd = 3, 4, 70, 16
    q, k, v = (
        torch.randn(b, h, t, hd, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    n = ops.padded_keys(t)
    pad = (0, 0, 0, n - t)
    causal = torch.arange(n) <= torch.arange(t)[:, None]
    full = ops.attention(q, F.pad(k, pad), F.pad(v, pad), causal.expand(b, t, n), 0.25)
    for i in (0, 5, 63, 64, t - 1):
        keys = ops.padded_keys(i + 1)
        kk = F.pad(k[:, :, : i + 1], (0, 0, 0, keys - i - 1))
        vv = F.pad(v[:, :, : i + 1], (0, 0, 0, keys - i - 1))
        allowed = (torch.arange(keys) <= i).expand(b, 1, keys)
        assert torch.equal(
            ops.attention(q[:, :, i : i + 1], kk, vv, allowed, 0.25), full[:, :, i : i + 1]
        )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    assert torch.allclose(full, ref, rtol=0, atol=t * F32_EPS * 10)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-moe-shared"])
def test_the_model_decodes_each_token_with_the_bits_of_the_trainers_forward(preset):
    """Prefill then one token per step over a slot KV cache (rows in other slots, one row
    alone) equals the full forward of the finished sequences; the trainer's forward (`install`,
    with gradients) is that forward, and all of it is the family's (within eps of HF's)."""
    model, _ = build_model(preset, seed=0, context=128)
    family = MODEL_FAMILIES.get(model.config.model_type)
    inv = family.invariant(model)
    cfg = model.config
    b, t, p = 3, 40, 12
    ids = torch.randint(3, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = inv.logits(ids, torch.arange(t).expand(b, t))
        hf = model(input_ids=ids).logits
        cache = SlotKVCache(cfg.num_hidden_layers, 4, inv.kv_heads, inv.length, inv.head_dim)
        slots = [2, 0, 1]
        assert torch.equal(
            inv.logits(ids[:, :p], torch.arange(p).expand(b, p), cache.kv, slots), full[:, :p]
        )
        for i in range(p, t):
            step = inv.logits(ids[:, i : i + 1], torch.full((b, 1), i), cache.kv, slots)
            assert torch.equal(step[:, 0], full[:, i]), i
        alone = SlotKVCache(cfg.num_hidden_layers, 1, inv.kv_heads, inv.length, inv.head_dim)
        assert torch.equal(inv.logits(ids[1:2], torch.arange(t)[None], alone.kv, [0]), full[1:2])
    assert torch.allclose(full, hf, rtol=0, atol=1e-5)
    trainer, _ = build_model(preset, seed=0, context=128)
    family.invariant(trainer).install()
    out = trainer(input_ids=ids).logits
    assert torch.equal(out.detach(), full)
    out.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in trainer.parameters())


def _config(tmp_path, *sets):
    return load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=say_a",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.lr=3e-3",
            f"checkpoint.root={tmp_path / 'ckpt'}",
            *sets,
        ],
    )


ENGINES_AND_MODES = {
    "embedded": [],
    "embedded-megatron": ["train.backend=megatron"],
    "embedded-qwen3_moe": ["model.preset=tiny-moe"],
    "serving-glm4_moe": [
        "model.preset=tiny-moe-shared",
        "rollout.engine=serving",
        "weight_sync.transport=colocated",
    ],
    "serving": ["rollout.engine=serving", "weight_sync.transport=colocated"],
    # an engine server and a producer; staleness 0, so every sample is the trainer's version's
    "server-fully_async": [
        "rollout.engine=server",
        "rollout.engine_options.threads=1",
        "weight_sync.transport=shared_memory",
        "rollout.mode=fully_async",
        "rollout.mode_options.max_staleness=0",
    ],
}


@pytest.mark.parametrize("engine", ENGINES_AND_MODES)
def test_a_run_logs_a_zero_train_rollout_gap_at_every_step(tmp_path, engine):
    assert _gaps(tmp_path, "train.true_on_policy=true", *ENGINES_AND_MODES[engine]) == [0.0] * 3


def test_without_the_mode_the_gap_is_measured_and_not_zero(tmp_path):
    gaps = _gaps(tmp_path)
    assert all(0 < g < 1e-4 for g in gaps), gaps


def _gaps(tmp_path, *sets) -> list[float]:
    """`train/train_rollout_logprob_abs_diff` of three steps of a tiny say_a run."""
    cfg = _config(tmp_path, *sets)
    rt = runtime.RLRuntime(cfg, runtime.prepare_model_dir(cfg, tmp_path / "init"), None)
    try:
        gaps = []
        for step in range(3):
            metrics = rt.train(rt.rollout(step))
            gaps.append(metrics["train/train_rollout_logprob_abs_diff"])
            rt.update_weights()
    finally:
        rt.close()
    return gaps


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            [
                "rollout.engine=serving",
                "weight_sync.transport=colocated",
                "rollout.engine_options.dtype=bfloat16",
            ],
            "rollout.engine serving: rollout.engine_options.dtype bfloat16: the invariant forward is float32",
        ),
        (["train.share_prompts=true"], "train.share_prompts: the shared-prompt forward"),
        (
            ["model.preset=tiny-moe", "train.routing_replay=true"],
            "train.routing_replay / check_routing_replay",
        ),
        (
            ["train.backend=megatron", "train.world_size=2", "train.parallel.tp=2"],
            r"train.backend megatron: train.parallel.tp=2: the invariant forward runs at tp = pp",
        ),
    ],
    ids=["engine", "share_prompts", "routing_replay", "backend"],
)
def test_a_setting_the_contract_excludes_is_refused_at_config_time(tmp_path, sets, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, "train.true_on_policy=true", *sets)


def test_a_model_the_invariant_forward_does_not_compute_is_refused_before_start(tmp_path):
    """A GLM4-MoE with partial rotary (its default): the invariant forward rotates every
    dimension; a model type with no family has none at all."""
    model, tok = build_model("tiny-moe-shared", seed=0)
    model.config.rope_parameters["partial_rotary_factor"] = 0.5
    save_hf_dir(model, tok, tmp_path / "partial")
    cfg = _config(tmp_path, "train.true_on_policy=true", f"model.path={tmp_path / 'partial'}")
    with pytest.raises(ValueError, match="train.true_on_policy cannot run .*partial_rotary_factor"):
        preflight(cfg)
    assert not (tmp_path / "ckpt").exists()
    assert TRUE_ON_POLICY.model_refused({"model_type": "llama"}) == (
        "model_type 'llama' has no model family (models/<family>/)"
    )
