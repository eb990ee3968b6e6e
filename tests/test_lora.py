"""LoRA (train.lora, miles_core/lora/): adapters trained with peft on a frozen base, pushed alone,
served per request unmerged; step 0 computes the base exactly, the engine's forward with an
adapter is the trainer's (bitwise under true on-policy), bad adapters and requests are refused."""

from __future__ import annotations

import pytest
import torch

from miles_core.config import load_config
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.cpu.serving import ServingEngine
from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams
from miles_core.lora.adapter import Adapter, engine_spec, read_adapter_dir
from miles_core.lora.served import AdapterRefused
from miles_core.models import load_hf_dir
from miles_core.run.training import build_trainer
from miles_core.train.batch import TrainBatch
from miles_core.types import Sample

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.lora.rank=4",
]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8, 12]]
SGLANG = [
    "rollout.engine=sglang",
    "rollout.engine_options.url=http://127.0.0.1:9",
    "weight_sync.transport=disk",
]


def _config(*sets):
    return load_config(None, [*SMALL, *sets])


def _request(ids, adapter, n=6):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0)  # greedy: any batch, same tokens
    return GenerateRequest(input_ids=ids, sampling_params=sp, lora_path=adapter)


def _batch(samples_ids: list[tuple[list[int], list[int]]], advantages=None) -> TrainBatch:
    samples = [
        Sample(
            group_index=0,
            index=i,
            rollout_id=f"r{i}",
            prompt="x",
            tokens=p + r,
            response_length=len(r),
            loss_mask=[1] * len(r),
            rollout_log_probs=[0.0] * len(r),
            reward=0.0,
        )
        for i, (p, r) in enumerate(samples_ids)
    ]
    return TrainBatch.from_samples(samples, advantages, 1.0)


def _step(trainer, pairs) -> None:
    """One optimizer step that moves the adapters (rewards that differ within the group)."""
    batch = _batch(pairs, [1.0 if i % 2 else -1.0 for i in range(len(pairs))])
    batch.old_is_current = True
    trainer.train_step(batch)


@pytest.fixture(scope="module")
def trained(tiny_dir):
    """A LoRA trainer (true on-policy) after two optimizer steps, and the engine inputs."""
    cfg = _config(
        "train.true_on_policy=true",
        "train.lr=0.05",
        "train.lora.target_modules=[q_proj, k_proj, o_proj, up_proj, down_proj, lm_head]",
    )
    trainer = build_trainer(cfg, tiny_dir)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    pairs = [(PROMPTS[i % 2], [20 + i, 21, 22 + i, 23]) for i in range(8)]
    _step(trainer, pairs)
    _step(trainer, pairs)
    yield cfg, trainer, base, pairs
    trainer.close()


def test_only_the_adapters_train_and_the_base_never_changes(trained):
    cfg, trainer, base, _ = trained
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    state = trainer.optimizer.state
    with_state = {id(p) for p in state}
    adapters = {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert with_state == adapters  # AdamW moments for the adapters alone
    for n, p in trainer.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n  # never merged, never drifted
    b = [p for n, p in trainer.model.named_parameters() if ".lora_B." in n]
    assert any(t.abs().sum() > 0 for t in b)  # B left zero: the steps moved it


def test_the_kl_reference_is_the_frozen_base_without_a_copy(tiny_dir):
    """With LoRA the KL reference is the policy with its adapters off (no second model):
    0 at the first step (B = 0), then the distance the adapters moved."""
    trainer = build_trainer(_config("train.loss_options.kl_coef=0.1", "train.lr=0.05"), tiny_dir)
    try:
        assert trainer.ref_model is None and trainer.ref_is_base
        pairs = [(PROMPTS[i % 2], [20 + i, 21, 22 + i]) for i in range(8)]
        kls = []
        for _ in range(2):
            batch = _batch(pairs, [1.0 if i % 2 else -1.0 for i in range(8)])
            batch.old_is_current = True
            kls.append(trainer.train_step(batch)["kl_loss"])
        assert kls[0] == 0.0 and kls[1] > 0.0
        assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    finally:
        trainer.close()


def test_step_zero_computes_the_base_model_bitwise(tiny_dir):
    """A fresh adapter (B = 0) adds exact zeros: the trainer's log-probs and an engine's tokens
    and log-probs equal the base model's bit for bit."""
    cfg = _config()
    lora = build_trainer(cfg, tiny_dir)
    plain = build_trainer(load_config(None, SMALL[:-1]), tiny_dir)
    try:
        batch = _batch([(PROMPTS[0], [20, 21, 22]), (PROMPTS[1], [23, 24])])
        assert lora.compute_log_probs(batch) == plain.compute_log_probs(batch)
    finally:
        lora.close(), plain.close()
    model, tok = load_hf_dir(tiny_dir)
    served = EmbeddedEngine(model, tok, lora=engine_spec(cfg.train.lora, model))
    bare = EmbeddedEngine(load_hf_dir(tiny_dir)[0], tok)
    a = served.generate([_request(PROMPTS[0], "default")])[0]
    b = bare.generate([_request(PROMPTS[0], None)])[0]
    assert (a.output_ids, a.output_log_probs) == (b.output_ids, b.output_log_probs)


@pytest.mark.parametrize("engine_class", [EmbeddedEngine, ServingEngine])
def test_the_engine_serves_the_trained_adapter_with_the_trainers_bits(
    trained, tiny_dir, engine_class
):
    """After a push of the adapters alone, the engine's log-probs of its own samples are the
    trainer's recompute bit for bit (true on-policy), in a batch that mixes the adapter and the
    base model row by row."""
    cfg, trainer, _, _ = trained
    model, tok = load_hf_dir(tiny_dir)
    spec = engine_spec(cfg.train.lora, model) | {"required": False}
    kw = {"scheduler": "caller"} if engine_class is ServingEngine else {}
    engine = engine_class(model, tok, true_on_policy=True, lora=spec, **kw)
    try:
        pushed = [nt for b in trainer.named_weights(1 << 20) for nt in b]
        assert all(n.startswith("lora.default.") for n, _ in pushed)
        engine.update_weights_from_tensor(pushed)
        mixed = engine.generate([_request(p, a) for p in PROMPTS for a in ("default", None)])
        alone = engine.generate([_request(p, "default") for p in PROMPTS])
        base = EmbeddedEngine(load_hf_dir(tiny_dir)[0], tok, true_on_policy=True)
        base_out = base.generate([_request(p, None) for p in PROMPTS])
    finally:
        engine.close()
    adapted = mixed[0::2]
    for m, a in zip(adapted, alone, strict=True):
        assert (m.output_ids, m.output_log_probs) == (a.output_ids, a.output_log_probs)
    for m, b in zip(mixed[1::2], base_out, strict=True):  # base rows beside adapter rows
        assert (m.output_ids, m.output_log_probs) == (b.output_ids, b.output_log_probs)
    recomputed = trainer.compute_log_probs(
        _batch([(p, r.output_ids) for p, r in zip(PROMPTS, alone, strict=True)])
    )
    assert recomputed == [r.output_log_probs for r in alone]
    assert any(a.output_ids != b.output_ids for a, b in zip(alone, base_out, strict=True))


def test_the_fast_forward_serves_the_adapter_within_float32_rounding(trained, tiny_dir):
    cfg, trainer, _, _ = trained
    _assert_served_within_float32(trainer, cfg, tiny_dir)


def _assert_served_within_float32(trainer, cfg, model_dir) -> None:
    """An embedded engine (the fast forward, or HF's modules) given the trainer's adapters
    generates tokens whose log-probs the trainer recomputes within float32 rounding: eps times
    the longest reduction (hidden_size), times 64 for the layers and ops it passes through."""
    model, tok = load_hf_dir(model_dir)
    engine = EmbeddedEngine(model, tok, lora=engine_spec(cfg.train.lora, model))
    engine.update_weights_from_tensor([nt for b in trainer.named_weights(1 << 20) for nt in b])
    out = engine.generate([_request(p, "default") for p in PROMPTS])
    got = trainer.compute_log_probs(
        _batch([(p, r.output_ids) for p, r in zip(PROMPTS, out, strict=True)])
    )
    bound = 64 * torch.finfo(torch.float32).eps * model.config.hidden_size
    for g, r in zip(got, out, strict=True):
        assert max(abs(x - y) for x, y in zip(g, r.output_log_probs, strict=True)) < bound


def test_a_mixture_of_experts_model_serves_its_adapters_on_the_hf_modules(tmp_path):
    """GLM4-MoE (a dense first layer, routed and shared experts): `all-linear` adapts the
    attention projections (peft would re-target MLP ones at the fused experts), the embedded
    engine runs HF's modules with the adapter terms hooked in, within float32 rounding of the
    trainer."""
    from miles_core.models import build_model, save_hf_dir

    model_dir = save_hf_dir(*build_model("tiny-moe-shared", seed=0), tmp_path / "moe")
    cfg = _config("train.lr=0.05", "model.preset=tiny-moe-shared")
    trainer = build_trainer(cfg, model_dir)
    try:
        assert trainer.lora_modules and all(".self_attn." in m for m in trainer.lora_modules)
        pairs = [(PROMPTS[i % 2], [20 + i, 21, 22 + i, 23]) for i in range(8)]
        _step(trainer, pairs)
        _assert_served_within_float32(trainer, cfg, model_dir)
    finally:
        trainer.close()


def test_requests_and_loads_the_adapter_table_cannot_take_are_refused(tiny_dir, tmp_path):
    model, tok = load_hf_dir(tiny_dir)
    cfg = _config()
    spec = engine_spec(cfg.train.lora, model) | {"max_loaded": 2}
    engine = ServingEngine(model, tok, scheduler="caller", lora=spec)
    try:
        with pytest.raises(EngineRequestError, match="every request must name its adapter"):
            engine.generate([_request(PROMPTS[0], None)])
        with pytest.raises(EngineRequestError, match="'nope': no such adapter is loaded"):
            engine.generate([_request(PROMPTS[0], "nope")])
        held = engine.adapters.loaded["default"]
        second = Adapter("second", held.config, dict(held.weights))
        second.save(tmp_path / "second")
        engine.load_lora_adapter("second", tmp_path / "second")
        with pytest.raises(AdapterRefused, match=r"2 adapters are loaded.*unload one first"):
            engine.load_lora_adapter_from_tensors("third", held.config, second.peft_tensors())
        engine.adapters.in_use["second"] += 1  # a queued request names it
        with pytest.raises(AdapterRefused, match="in use by 1 queued or running requests"):
            engine.unload_lora_adapter("second")
        engine.adapters.in_use["second"] -= 1
        engine.unload_lora_adapter("second")
        wrong = {
            k: v[:, :-1] if k.endswith("lora_A.weight") else v
            for k, v in second.peft_tensors().items()
        }
        with pytest.raises(AdapterRefused, match="an adapter for another base"):
            engine.load_lora_adapter_from_tensors("other", held.config, wrong)
        with pytest.raises(AdapterRefused, match="rank 0 / scaling 0.0 invalid"):
            engine.load_lora_adapter_from_tensors("zero", held.config | {"r": 0}, wrong)
        names = ["default"]
        assert [a["name"] for a in engine.lora_adapters()] == names
    finally:
        engine.close()
    plain = EmbeddedEngine(load_hf_dir(tiny_dir)[0], tok)
    with pytest.raises(EngineRequestError, match="serves no adapters"):
        plain.generate([_request(PROMPTS[0], "default")])


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.lora.rank=0"], "train.lora.rank must be a positive integer, got 0"),
        (["train.lora.target_modules=[wq]"], "module 'wq' matches no linear layer of this model"),
        (["train.lora.exclude_modules=[embed_tokens]"], "module 'embed_tokens' matches no linear"),
        (["train.backend=megatron"], "megatron-core ships no LoRA layers"),
        (["rollout.precision=fp8", "train.qat=true"], "train.lora with train.qat"),
        (["rollout.precision=fp8"], "train.lora with rollout.precision fp8"),
        (
            [
                "train.lora.adapters=[a, b]",
                "agent.function=miles_core.envs.sandbox_agent:run_agent",
                "rollout.engine=server",
                "weight_sync.transport=shared_memory",
                "data.task=terminal",
            ],
            "several adapters with agent.function",
        ),  # fmt: skip
        (["train.lora.adapters=['a b']"], "is not a name of 1-64 letters"),
        (["eval.mode=dedicated"], "train.lora with eval.mode dedicated"),
        (
            ["model.preset=tiny-moe-shared", "train.lora.target_modules=[q_proj, gate_proj]"],
            "on a mixture-of-experts model peft adapts the fused experts",
        ),
        # an engine that cannot replace an adapter in place (SGLang): each push is a new version
        (
            [*SGLANG, "weight_sync.transport=broadcast"],
            "transport broadcast with train.lora.*use disk",
        ),
        (
            [*SGLANG, "rollout.mode=fully_async"],
            "fully_async with train.lora.*in flight across a push",
        ),
        (
            [
                *SGLANG,
                "agent.function=miles_core.envs.sandbox_agent:run_agent",
                "data.task=terminal",
            ],
            "agent.function with train.lora.*not its current version",
        ),
        ([*SGLANG, "weight_sync.check_equal=true"], "check_equal with train.lora.*cover adapters"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_before_start(sets, message):
    from miles_core.run.preflight import _check_lora, _model_config

    with pytest.raises(ValueError, match=message):
        config = _config(*sets)
        _check_lora(config, _model_config(config), "model.preset")


def test_a_checkpoint_holds_a_peft_adapter_that_peft_loads_on_the_base(trained, tiny_dir, tmp_path):
    """The saved adapter directory is peft's: `PeftModel.from_pretrained` on the base computes
    the trainer's logits; loading it back restores the adapters bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, trainer, _, pairs = trained
    trainer.save(str(tmp_path / "ck"))
    adapter = read_adapter_dir(tmp_path / "ck" / "adapters" / "default", "default")
    assert adapter.config["r"] == 4 and adapter.weights
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "ck" / "adapters" / "default").eval()
    ids = torch.tensor([pairs[0][0] + pairs[0][1]])
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        trainer.model.eval()
        ours = trainer.model(input_ids=ids).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)
    again = build_trainer(cfg, tiny_dir)
    try:
        again.load(str(tmp_path / "ck"))
        mine = dict(trainer.model.named_parameters())
        for n, p in again.model.named_parameters():
            assert torch.equal(p, mine[n]), n
    finally:
        again.close()


# ---------------------------------------------------------------------- the engine server
@pytest.fixture(scope="module")
def lora_server(tiny_dir, tmp_path_factory):
    """An engine server serving the run's adapter (declared by config) and up to 2 adapters."""
    import json

    from tests.servers import engine_client

    model, _ = load_hf_dir(tiny_dir)
    spec = engine_spec(_config().train.lora, model) | {"max_loaded": 2}
    args = ["--threads", "1", "--lora", json.dumps(spec)]
    with engine_client(tiny_dir, args, tmp_path_factory) as client:
        yield client, spec["adapters"]["default"]


def _adapter_tensors(config, seed) -> dict[str, torch.Tensor]:
    """Random tensors for every module of an adapter, by wire name."""
    from miles_core.lora.names import wire_name

    model, _ = load_hf_dir(_TINY[0])
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if n in config["target_modules"]
    }
    g = torch.Generator().manual_seed(seed)
    r = config["r"]
    out = {}
    for module, (o, i) in shapes.items():
        out[wire_name("default", module, "lora_A")] = torch.randn(r, i, generator=g)
        out[wire_name("default", module, "lora_B")] = torch.randn(o, r, generator=g)
    return out


_TINY: list = []


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(autouse=True)
def _tiny_path(tiny_dir):
    _TINY[:] = [tiny_dir]


class _WithConfigs:
    """A trainer-like source that knows its adapters' peft configs (a disk push then writes
    peft directories)."""

    def __init__(self, buckets, configs):
        self.named_weights, self.configs = buckets.named_weights, configs

    def adapter_configs(self) -> dict:
        return self.configs


@pytest.mark.parametrize("name", ["shared_memory", "disk", "disk_peft", "broadcast", "p2p"])
def test_every_transport_pushes_the_adapter_alone_bitwise(lora_server, tmp_path, name):
    """disk: the transport's manifest format; disk_peft: from a source that knows the adapters'
    configs, a peft directory per adapter that `/load_lora_adapter` loads (and peft reads)."""
    from miles_core.weights import TRANSPORTS, weights_checksum
    from miles_core.weights.source import TensorBuckets
    from miles_core.weights.transports.disk import DiskTransport, version_dir
    from tests.test_transports import _TwoRankShards

    server, config = lora_server
    base = server.weights_checksum("base")
    disk = name.startswith("disk")
    transport = DiskTransport(root=str(tmp_path / "w"), keep=1) if disk else TRANSPORTS.get(name)()
    transport.connect([server])
    ranks = _TwoRankShards({})  # p2p: two trainer ranks, the group formed once
    try:
        for version, seed in ((31, 1), (32, 2)):
            tensors = _adapter_tensors(config, seed)
            if name == "p2p":
                ranks.weights = tensors
                source = ranks
            elif name == "disk_peft":
                source = _WithConfigs(TensorBuckets(tensors, per=7), {"default": config})
            else:
                source = TensorBuckets(tensors, per=7)
            stats = transport.push(source, version=version, pause_mode="retract")
            assert server.weights_checksum("adapters") == weights_checksum(tensors.items())
            # the adapter's bytes (a disk push adds its file headers and manifest)
            assert adapter_bytes(tensors) <= stats.bytes < 2 * adapter_bytes(tensors)
            assert server.weight_version == version
        if name == "disk_peft":
            pushed = read_adapter_dir(
                f"{version_dir(str(tmp_path / 'w'), 32)}/adapters/default", "x"
            )
            assert pushed.config["r"] == config["r"] and len(pushed.weights) == len(tensors) // 2
    finally:
        getattr(transport, "close", lambda: None)()
    assert server.weights_checksum("base") == base  # the base never travels, never changes


def test_the_servers_lora_routes_answer_as_sglangs(lora_server, tiny_dir, tmp_path):
    """Load from a peft directory (under the weight roots only) or from tensors, per-request
    and per-item `lora_path`, the adapter limit and unknown adapters as 4xx, unload."""
    import json

    import httpx

    server, config = lora_server
    tensors = {k.split(".", 2)[2]: v for k, v in _adapter_tensors(config, 3).items()}
    peft_keyed = {f"base_model.model.{k}": v for k, v in tensors.items()}
    adapter = Adapter("x", config, {})
    from miles_core.lora.adapter import pairs_of

    adapter.weights = pairs_of(peft_keyed)
    adapter.save(tmp_path / "x")
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=30)  # noqa: E731
    ok = post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "x")})
    assert ok.status_code == 200 and set(ok.json()["loaded_adapters"]) == {"default", "x"}
    outside = post("/load_lora_adapter", {"lora_name": "y", "lora_path": "/etc"})
    assert outside.status_code == 400 and "not under the roots" in outside.json()["message"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("[1, 2]")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    corrupt = post("/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path / "bad")})
    assert corrupt.status_code == 400 and "not a JSON object" in corrupt.json()["message"]
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(config))
    corrupt = post("/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path / "bad")})
    assert corrupt.status_code == 400 and "not safetensors" in corrupt.json()["message"]
    full = server.load_lora_adapter_from_tensors
    with pytest.raises(Exception, match="2 adapters are loaded"):
        full("y", config, peft_keyed)
    body = {"input_ids": [PROMPTS[0], PROMPTS[1]], "sampling_params": {"max_new_tokens": 3},
            "lora_path": ["x", "default"]}  # fmt: skip
    out = post("/generate", body)
    assert out.status_code == 200 and len(out.json()) == 2
    unknown = post("/generate", {"input_ids": PROMPTS[0], "lora_path": "nope"})
    assert unknown.status_code == 400 and "no such adapter is loaded" in unknown.json()["message"]
    missing = post("/generate", {"input_ids": PROMPTS[0]})
    assert missing.status_code == 400 and "must name its adapter" in missing.json()["message"]
    pickled = post("/load_lora_adapter_from_tensors", {"lora_name": "z", "config_dict": config,
                   "serialized_named_tensors": ["gASV"]})  # fmt: skip
    assert pickled.status_code == 400 and "never unpickles" in pickled.json()["message"]
    server.unload_lora_adapter("x")
    full("y", config, peft_keyed)  # room again
    assert sorted(a["name"] for a in server.lora_adapters()) == ["default", "y"]
    server.unload_lora_adapter("y")


def test_an_engine_without_upsert_takes_each_push_as_a_new_version(lora_server, tmp_path):
    """Through a client declaring SGLang's routes (no in-place replacement), each disk push loads
    `default@v<version>`, points the requests at it and unloads the version it replaced; a push
    refused for its shapes leaves the version before serving; a stale version beside the
    current one shows in the adapters' checksum."""
    from miles_core.engines.http import HttpEngine
    from miles_core.engines.protocol import EngineRequestRejected
    from miles_core.engines.sglang import SGLANG_ROUTES
    from miles_core.weights import weights_checksum
    from miles_core.weights.remote import PushFailed
    from miles_core.weights.source import TensorBuckets
    from miles_core.weights.transports.disk import DiskTransport, version_dir

    server, config = lora_server
    engine = HttpEngine(server.url, weight_routes=SGLANG_ROUTES)
    root = str(tmp_path / "w")
    transport = DiskTransport(root=root, keep=2)
    transport.connect([engine])
    source = lambda t: _WithConfigs(TensorBuckets(t, per=7), {"default": config})  # noqa: E731
    held = lambda: sorted(a["name"] for a in server.lora_adapters())  # noqa: E731
    pushed = {v: _adapter_tensors(config, v) for v in (51, 52)}
    try:
        for version, tensors in pushed.items():
            transport.push(source(tensors), version)
        assert held() == ["default@v52"] and engine.served_adapters == {"default": "default@v52"}
        assert engine.weights_checksum("adapters") == weights_checksum(pushed[52].items())
        assert engine.weight_version == 52
        [out] = engine.generate([_request(PROMPTS[0], "default", n=2)])
        assert len(out.output_ids) == 2
        with pytest.raises(EngineRequestRejected, match="'default@v51': no such adapter"):
            engine.generate([_request(PROMPTS[0], "default@v51", n=2)])
        engine.load_lora_adapter("default@v51", f"{version_dir(root, 51)}/adapters/default")
        assert engine.weights_checksum("adapters") != weights_checksum(pushed[52].items())
        engine.unload_lora_adapter("default@v51")
        wrong = {n: torch.zeros(t.shape[0], t.shape[1] + 1) for n, t in pushed[52].items()}
        with pytest.raises(PushFailed, match="did not load adapter default@v53.*keep serving"):
            transport.push(source(wrong), 53)
        assert held() == ["default@v52"] and engine.served_adapters == {"default": "default@v52"}
        assert engine.weights_checksum("adapters") == weights_checksum(pushed[52].items())
    finally:  # the module's server serves `default` under its own name again
        names = held()
        if "default" not in names:
            server.load_lora_adapter("default", f"{version_dir(root, 52)}/adapters/default")
        for name in names:
            if name != "default":
                server.unload_lora_adapter(name)
        engine.close()


def test_a_refused_version_unloads_what_its_push_loaded_and_re_points_nothing():
    from miles_core.engines.protocol import EngineRequestRejected
    from miles_core.lora.versions import push_versions
    from miles_core.weights.remote import PushFailed

    class Engine:  # an SGLang-like server: a name loads once, each load lists what is loaded
        url = "http://sglang"

        def __init__(self):
            self.loaded = {"a@v1", "b@v1"}
            self.served_adapters = {"a": "a@v1", "b": "b@v1"}

        def load_lora_adapter(self, name, path):
            if path == "refused" or name in self.loaded:
                raise EngineRequestRejected(f"cannot load {name}")
            self.loaded.add(name)
            return {"success": True, "loaded_adapters": {n: n for n in self.loaded}}

        def unload_lora_adapter(self, name):
            self.loaded.remove(name)

    engine = Engine()
    with pytest.raises(PushFailed, match="did not load adapter b@v2 from refused"):
        push_versions(engine, {"a": "ok", "b": "refused"}, 2)
    assert engine.loaded == {"a@v1", "b@v1"}
    assert engine.served_adapters == {"a": "a@v1", "b": "b@v1"}
    push_versions(engine, {"a": "ok", "b": "ok"}, 2)
    assert engine.loaded == {"a@v2", "b@v2"}
    assert engine.served_adapters == {"a": "a@v2", "b": "b@v2"}


def test_a_lora_run_is_on_policy_pushes_only_the_adapter_and_resumes_bitwise(
    tmp_path, mlflow_store
):
    """A LoRA run with true on-policy and the bitwise check: the log-prob gap is 0 at every
    step and each push carries the adapter's bytes (a small fraction of the model's). Each
    checkpoint's adapter is a model version in MLflow whose config names the base saved once
    beside the checkpoints; resuming step 0 trains step 1 to the same bits."""
    import json

    from mlflow.tracking import MlflowClient

    from miles_core.run import runtime
    from miles_core.run.tracking import Tracker

    config = _config(
        "train.true_on_policy=true",
        "weight_sync.check_equal=true",
        "train.num_steps=2",
        "checkpoint.interval=1",
        f"checkpoint.root={tmp_path / 'ckpt'}",
        f"tracking.tracking_uri={mlflow_store}",
    )
    init = runtime.prepare_model_dir(config, tmp_path / "init")

    def run(steps, resume=None):
        tracker = Tracker(mlflow_store, "lora", config.name)
        rt = runtime.RLRuntime(config, init, tracker)
        out = []
        try:
            if resume is not None:
                rt.resume(resume)
            held = rt.fleet.engine.weights.tensors
            model_bytes = adapter_bytes(held("base"))
            for step in steps:
                metrics = rt.train(rt.rollout(step))
                assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
                pushed = rt.update_weights()["perf/weight_sync_bytes"]
                assert pushed == adapter_bytes(held("adapters")) < model_bytes / 10
                rt.save(step, metrics)
                out.append((metrics, {n: t.clone() for n, t in held("adapters").items()}))
        finally:
            rt.close()
            tracker.finish()
        return out

    first = run([0, 1])
    again = run([1], resume=0)
    assert again[0][0] == first[1][0]  # the step's metrics, and the adapter it trained
    assert all(torch.equal(t, first[1][1][n]) for n, t in again[0][1].items())
    base = tmp_path / "ckpt" / config.name / "base_model"
    assert (base / "model.safetensors").is_file()
    saved = tmp_path / "ckpt" / config.name / "step_000001" / "adapters" / "default"
    assert json.loads((saved / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base)
    versions = MlflowClient(mlflow_store).search_model_versions(f"name='{config.name}'")
    assert {v.source for v in versions} >= {str(saved)}
    assert all(v.tags.get("lora_adapter") == "default" for v in versions), [
        v.tags.get("lora_adapter") for v in versions
    ]


# ---------------------------------------------------------------------- several adapters
def test_each_adapter_steps_as_if_trained_alone_and_leaves_the_others(tiny_dir):
    """Multi-LoRA: stepping adapter a (its own AdamW state, its loss over its own samples)
    gives a the bits a one-adapter run gets from the same step, and leaves b as it was."""
    pairs = [(PROMPTS[i % 2], [20 + i, 21, 22 + i]) for i in range(4)]
    both = build_trainer(_config("train.lora.adapters=[a, b]", "train.lr=0.05"), tiny_dir)
    alone = build_trainer(_config("train.lora.adapters=[a]", "train.lr=0.05"), tiny_dir)
    try:
        b_before = {n: p.clone() for n, p in both.model.named_parameters() if ".b." in n}
        both.use_adapter("a")
        _step(both, pairs)
        _step(alone, pairs)
        mine = dict(alone.model.named_parameters())
        stepped = [
            (n, p)
            for n, p in both.model.named_parameters()
            if ".lora_A.a." in n or ".lora_B.a." in n
        ]
        assert stepped and all(torch.equal(p, mine[n]) for n, p in stepped)
        assert all(
            torch.equal(p, b_before[n]) for n, p in both.model.named_parameters() if ".b." in n
        )
        assert {id(p) for p in both.optimizer.state} == {id(p) for _, p in stepped}
        both.use_adapter("b")
        assert not both.optimizer.state  # b's own AdamW: nothing yet
    finally:
        both.close(), alone.close()


def test_stepping_one_adapter_leaves_anothers_served_bytes_and_outputs(tiny_dir):
    """A push of adapter a alone: b's tensors on the engine and its greedy outputs are
    unchanged, a's are the pushed ones."""
    from miles_core.weights import weights_checksum

    model, tok = load_hf_dir(tiny_dir)
    spec = engine_spec(_config("train.lora.adapters=[a, b]").train.lora, model)
    engine = EmbeddedEngine(model, tok, true_on_policy=True, lora=spec)
    config = spec["adapters"]["a"]
    g = torch.Generator().manual_seed(5)
    for name in ("a", "b"):  # both adapters move off zero first
        tensors = {k.replace("lora.default.", f"lora.{name}."): torch.randn(v.shape, generator=g)
                   for k, v in _adapter_tensors(config, 1).items()}  # fmt: skip
        engine.update_weights_from_tensor(tensors.items())
    b_bytes = weights_checksum(
        (n, t) for n, t in engine.weights.tensors("adapters").items() if n.startswith("lora.b.")
    )
    b_out = engine.generate([_request(p, "b") for p in PROMPTS])
    a_out = engine.generate([_request(p, "a") for p in PROMPTS])
    new_a = {
        k.replace("lora.default.", "lora.a."): v for k, v in _adapter_tensors(config, 9).items()
    }
    engine.update_weights_from_tensor(new_a.items())
    held = engine.weights.tensors("adapters")
    assert all(torch.equal(held[n], t) for n, t in new_a.items())
    assert weights_checksum((n, t) for n, t in held.items() if n.startswith("lora.b.")) == b_bytes
    after = engine.generate([_request(p, "b") for p in PROMPTS])
    assert [(r.output_ids, r.output_log_probs) for r in after] == [
        (r.output_ids, r.output_log_probs) for r in b_out
    ]
    moved = engine.generate([_request(p, "a") for p in PROMPTS])
    assert [r.output_log_probs for r in moved] != [r.output_log_probs for r in a_out]


def test_a_multi_lora_run_trains_each_adapter_on_its_rows_and_pushes_those_that_stepped(tmp_path):
    """Two adapters on a mixture of say_a and reverse rows, each row naming its adapter; the
    data in order, two prompts a step: step 0 has only a's rows, step 1 only b's. Each push
    carries the adapter that stepped, the engine then holds the trainer's bytes of both."""
    import json

    from miles_core.run import runtime

    rows = [{"prompt": "say a", "label": {"task": "say_a"}, "adapter": "a"}] * 2
    rows += [
        {"prompt": "reverse abcd", "label": {"task": "reverse", "label": "dcba"}, "adapter": "b"}
    ] * 2
    data = tmp_path / "mix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(
        "train.lora.adapters=[a, b]",
        "data.task=mixture",
        f"data.path={data}",
        "data.shuffle=false",
        "weight_sync.check_equal=true",
        "train.num_steps=2",
        f"checkpoint.root={tmp_path / 'ckpt'}",
    )
    from miles_core.run.preflight import preflight

    preflight(config)
    rt = runtime.RLRuntime(config, runtime.prepare_model_dir(config, tmp_path / "init"), None)
    try:
        held = rt.fleet.engine.weights.tensors
        for step, name in ((0, "a"), (1, "b")):
            result = rt.rollout(step)
            assert {s.metadata["adapter"] for s in result.samples} == {name}
            metrics = rt.train(result)
            other = "b" if name == "a" else "a"
            assert f"train/loss/{name}" in metrics and f"train/loss/{other}" not in metrics
            pushed = rt.update_weights()["perf/weight_sync_bytes"]
            mine = {n: t for n, t in held("adapters").items() if n.startswith(f"lora.{name}.")}
            assert pushed == adapter_bytes(mine)  # that adapter alone
    finally:
        rt.close()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "x", "label": {"task": "say_a"}}], "row 1 names no adapter"),
        (
            [{"prompt": "x", "label": {"task": "say_a"}, "adapter": "c"}],
            "names adapter 'c', none of",
        ),
    ],
)
def test_multi_lora_rows_must_name_one_of_the_adapters(tmp_path, rows, message):
    import json

    from miles_core.data import read_jsonl
    from miles_core.run.preflight import _check_adapters

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config("train.lora.adapters=[a, b]", "data.task=mixture", f"data.path={data}")
    with pytest.raises(ValueError, match=message):
        _check_adapters(config, read_jsonl(str(data)), str(data))
