"""True on-policy: each invariant kernel gives a row the same bits alone and inside any batch, a
decode over t keys equals row t of the full forward, the model's engine-side and trainer-side
forwards agree bitwise, and a run logs a train/rollout log-prob gap of exactly 0 at every step
(and a non-zero one without the mode: the metric is measured, not assumed)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from miles_core.data import TASKS, PromptSource, load_examples
from miles_core.engines.cpu.kv_cache import SlotKVCache
from miles_core.engines.http import EngineProcess, HttpEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import build_model, load_hf_dir, save_hf_dir
from miles_core.models.family import MODEL_FAMILIES
from miles_core.rollout.producer import RolloutProducer
from miles_core.run import runtime
from miles_core.run.preflight import preflight
from miles_core.run.training import build_trainer
from miles_core.train.batch import TrainBatch
from miles_core.true_on_policy import ops
from miles_core.true_on_policy.behaviour import behaviour_log_probs
from miles_core.true_on_policy.contract import TRUE_ON_POLICY
from miles_core.weights import TRANSPORTS
from tests.runs import tiny_say_a

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


def test_in_bfloat16_a_decode_equals_the_full_forward_and_both_are_bfloat16():
    model, _ = build_model("tiny", seed=0, context=128)
    inv = MODEL_FAMILIES.get(model.config.model_type).invariant(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator())
    positions = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        fp32 = inv.logits(ids, positions)
        inv.dtype = torch.bfloat16
        full = inv.logits(ids, positions)
        cache = SlotKVCache(
            model.config.num_hidden_layers,
            2,
            inv.kv_heads,
            inv.length,
            inv.head_dim,
            torch.bfloat16,
        )
        assert torch.equal(inv.logits(ids[:, :5], positions[:, :5], cache.kv, [1, 0]), full[:, :5])
        for i in range(5, 20):
            step = inv.logits(ids[:, i : i + 1], positions[:, i : i + 1], cache.kv, [1, 0])
            assert torch.equal(step[:, 0], full[:, i]), i
    assert torch.equal(full, full.to(torch.bfloat16).float())  # logits are bf16 values
    gap = (full - fp32).abs().max()  # bf16 rounding, not another model
    assert 0 < gap < 0.1 * fp32.abs().max(), gap


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_routing_replay_runs_the_experts_it_is_given(preset):
    """Replaying a forward's own routes changes no bit; replaying others runs those experts."""
    model, _ = build_model(preset, seed=0, context=64)
    inv = MODEL_FAMILIES.get(model.config.model_type).invariant(model)
    inv.record_routes = True
    ids = torch.randint(
        3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        natural = inv.logits(ids, positions)
        routes = inv.last_routes  # [B, T, MoE layers, k]
        assert routes.shape[2:] == inv.routes_shape
        seen = []
        inv.choose = lambda layer, chosen: seen.append(layer) or chosen
        assert torch.equal(inv.logits(ids, positions), natural)
        assert seen == list(range(inv.routes_shape[0]))
        fixed = torch.arange(inv.routes_shape[1]).expand(18, -1)  # every row: experts 0..k-1
        inv.choose = lambda layer, chosen: fixed
        forced = inv.logits(ids, positions)
    assert (inv.last_routes == fixed.view(2, 9, 1, -1)).all()
    assert not torch.equal(forced, natural)


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


_config = tiny_say_a


ENGINES_AND_MODES = {
    "embedded": [],
    "embedded-megatron": ["train.backend=megatron"],
    "embedded-qwen3_moe": ["model.preset=tiny-moe"],
    # routing replay: the engine records each token's experts, the trainer runs them
    "serving-glm4_moe-replay": [
        "model.preset=tiny-moe-shared",
        "rollout.engine=serving",
        "weight_sync.transport=colocated",
        "train.routing_replay=true",
        "train.check_routing_replay=true",
    ],
    "serving": ["rollout.engine=serving", "weight_sync.transport=colocated"],
    # both sides round every weight and activation to bf16, the KV cache held in bf16
    "serving-bf16": [
        "rollout.engine=serving",
        "weight_sync.transport=colocated",
        "rollout.engine_options.dtype=bfloat16",
    ],
    # an engine server and a producer running a step ahead: stale samples, recomputed under
    # the weights that generated them
    "server-fully_async": [
        "rollout.engine=server",
        "rollout.engine_options.threads=1",
        "weight_sync.transport=shared_memory",
        "rollout.mode=fully_async",
        "rollout.mode_options.max_staleness=1",
    ],
}


@pytest.mark.parametrize("engine", ENGINES_AND_MODES)
def test_a_run_logs_a_zero_train_rollout_gap_at_every_step(tmp_path, engine):
    steps, rt = _steps(tmp_path, "train.true_on_policy=true", *ENGINES_AND_MODES[engine])
    assert [m["train/train_rollout_logprob_abs_diff"] for m in steps] == [0.0] * 3
    if "fully_async" in engine:  # it trained stale tokens: the policy's lag is measured apart
        assert any(m.get("train/policy_lag_logprob_abs_diff", 0) > 0 for m in steps), steps
    if "replay" in engine:  # both sides route from the same bits: the checker counts none
        assert [m["train/routing_mismatch_fraction"] for m in steps] == [0.0] * 3
        assert rt.trainer.routing.totals[1] > 0  # (position, layer) pairs replayed and checked


def test_without_the_mode_the_gap_is_measured_and_not_zero(tmp_path):
    gaps = [m["train/train_rollout_logprob_abs_diff"] for m in _steps(tmp_path)[0]]
    assert all(0 < g < 1e-4 for g in gaps), gaps


@pytest.fixture(scope="module")
def invariant_server(tiny_dir):
    proc = EngineProcess(tiny_dir, args=["--threads", "1", "--true-on-policy"]).start()
    client = HttpEngine(proc.url)
    yield client
    client.close()
    proc.stop()


def test_an_engine_in_the_mode_reports_token_versions_unasked(invariant_server):
    """A router in front of engine servers passes no request flag of ours: the versions come
    with every response."""
    req = GenerateRequest(input_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=4))
    (resp,) = invariant_server.generate([req])
    version = invariant_server.weight_version
    assert resp.token_fields["token_versions"].tolist() == [version] * len(resp.output_ids)


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
def test_a_sample_spanning_a_push_is_recomputed_under_the_weights_of_each_token(
    invariant_server, tiny_dir, tmp_path, pause_mode
):
    """A push meets requests mid-generation: aborted ones are continued by the rollout client,
    retracted ones resume inside the engine. Each token carries the version that generated it,
    and the trainer reproduces every log-prob bitwise: the old tokens under its kept weights of
    the old version, the others under its own."""
    engine = invariant_server
    cfg = _config(
        tmp_path,
        "train.true_on_policy=true",
        "rollout.engine=server",
        "weight_sync.transport=shared_memory",
        "rollout.mode=fully_async",
        "rollout.max_new_tokens=48",
        f"rollout.pause_mode={pause_mode}",
    )
    trainer = build_trainer(cfg, tiny_dir)
    transport = TRANSPORTS.get("shared_memory")()
    transport.connect([engine])
    start = engine.weight_version + 1  # the engine is the module's: it starts from the trainer
    transport.push(trainer, version=start)
    trainer.keep_weights(start, oldest=start)
    version = [start]
    _, tok = load_hf_dir(tiny_dir)
    source = PromptSource(load_examples("reverse", None, 64, 0), seed=0)
    producer = RolloutProducer(
        engine, tok, TASKS.get("reverse"), source, cfg.rollout, version=lambda: version[0]
    ).start()
    try:
        # the push must meet running requests that have tokens already: two engine steps
        # (admit and prefill, decode) with requests still running
        steps = engine.load_counters()["steps"]
        deadline = time.monotonic() + 30
        while engine.server_info()["running"] == 0 or engine.load_counters()["steps"] < steps + 2:
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.005)
        engine.pause("in_place")  # freeze them mid-generation, so the push meets them
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the next policy: the trainer's weights moved
            for p in trainer.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        transport.push(trainer, version=start + 1, pause_mode=pause_mode)
        engine.resume()
        version[0] = start + 1
        producer.notify_version()
        samples = producer.take(0).samples
    finally:
        producer.stop()
        transport.close()
    made = [s.token_fields["token_versions"] for s in samples]
    assert all(set(v.tolist()) <= {start, start + 1} for v in made)
    assert any(v[0] == start and v[-1] == start + 1 for v in made)  # generated across the push
    batch = TrainBatch.from_samples(samples, None, cfg.rollout.temperature)
    old = behaviour_log_probs(trainer, batch, start + 1, max_lag=1)
    own = trainer.compute_log_probs(batch)
    for s, o, c in zip(samples, old, own, strict=True):
        recomputed = [c_j if math.isnan(o_j) else o_j for o_j, c_j in zip(o, c, strict=True)]
        assert recomputed == s.rollout_log_probs


def _steps(tmp_path, *sets) -> tuple[list[dict[str, float]], runtime.RLRuntime]:
    """The train metrics of three steps of a tiny say_a run, and its (closed) runtime."""
    cfg = _config(tmp_path, *sets)
    rt = runtime.RLRuntime(cfg, runtime.prepare_model_dir(cfg, tmp_path / "init"), None)
    try:
        steps = []
        for step in range(3):
            steps.append(rt.train(rt.rollout(step)))
            rt.update_weights()
    finally:
        rt.close()
    return steps, rt


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            [
                "rollout.engine=sglang",
                "rollout.engine_options.url=http://127.0.0.1:1",
                "weight_sync.transport=disk",
            ],
            "rollout.engine sglang: it does not run the invariant forward",
        ),
        (["train.share_prompts=true"], "train.share_prompts: the shared-prompt forward"),
        (
            ["train.backend=megatron", "train.world_size=2", "train.parallel.tp=2"],
            r"train.backend megatron: train.parallel.tp=2: the invariant forward runs at tp = pp",
        ),
        (
            [
                "rollout.engine=server",
                "weight_sync.transport=shared_memory",
                "rollout.mode=fully_async",
                "rollout.pause_mode=in_place",
            ],
            "rollout.pause_mode in_place",
        ),
    ],
    ids=["engine", "share_prompts", "backend", "pause_mode"],
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
    moe = _config(
        tmp_path, "train.true_on_policy=true", "train.backend=megatron", "model.preset=tiny-moe"
    )
    with pytest.raises(ValueError, match="Megatron's invariant forward is dense"):
        preflight(moe)
    assert TRUE_ON_POLICY.model_refused({"model_type": "llama"}) == (
        "model_type 'llama' has no model family (models/<family>/)"
    )
