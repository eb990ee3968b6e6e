"""Mixture-of-experts models: the presets build their HF family (Qwen3-MoE; GLM4-MoE with a
shared expert and a dense first layer), train with FSDP2 through the HF modules and generate on
the embedded engine; an engine whose forward is dense-only refuses them before anything starts."""

from __future__ import annotations

import base64
import struct

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_core.config import load_config
from miles_core.engines.registry import ENGINES
from miles_core.models import PRESETS, build_model, count_parameters, moe, save_hf_dir
from miles_core.models.builder import preset_config
from miles_core.models.tokenizer import build_tokenizer
from miles_core.run import runtime
from miles_core.run.preflight import preflight
from miles_core.token_fields import FIELDS, declare_for_model, token_field

MOE = sorted(name for name, p in PRESETS.items() if p.is_moe)


@pytest.fixture(autouse=True)
def _forget_routed_experts():
    """A run declares the model's `routed_experts` field in this process: undeclared after each
    test, so no other test meets it."""
    yield
    if "routed_experts" in FIELDS:
        FIELDS.unregister("routed_experts")


def test_every_preset_builds_its_family_and_a_type_without_one_is_refused_by_name():
    """A preset's config is its family's (`models/<model_type>/`), of the model class the family
    names; a model type no folder holds has no serving runner, and the reason says why."""
    from types import SimpleNamespace

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from miles_core.models.family import MODEL_FAMILIES, runner_refuses

    assert MODEL_FAMILIES.names() == ["glm4_moe", "qwen3", "qwen3_moe"]
    tok = build_tokenizer()
    for name, preset in PRESETS.items():
        family = MODEL_FAMILIES.get(preset.family)
        config = preset_config(name, len(tok), tok.pad_token_id, tok.eos_token_id)
        assert config.model_type == family.name, name
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.name] == family.hf_class, name
        assert runner_refuses(config) is None, name
    assert runner_refuses(SimpleNamespace(model_type="llama")) == (
        "model_type 'llama' has no model family here (models/<family>/; the embedded engine "
        "runs any model transformers loads)"
    )


def test_moe_presets_route_every_token_on_their_moe_layers_and_reload_offline(tmp_path):
    assert MOE == ["small-moe", "tiny-moe", "tiny-moe-shared"]
    tok = build_tokenizer()
    sizes = {}
    for name in MOE:  # sizes from a build on the meta device: no memory, no init
        config = preset_config(name, len(tok), tok.pad_token_id, tok.eos_token_id)
        with torch.device("meta"):
            sizes[name] = count_parameters(AutoModelForCausalLM.from_config(config))
    assert 200_000 <= sizes["tiny-moe"] <= 300_000
    assert 9_000_000 <= sizes["small-moe"] <= 11_000_000
    assert 250_000 <= sizes["tiny-moe-shared"] <= 350_000
    for name in ("tiny-moe", "tiny-moe-shared"):
        p = PRESETS[name]
        model, tok = build_model(name, seed=0)
        ids = torch.tensor([tok.encode("reverse abcd", add_special_tokens=False)])
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        moe_layers = p.num_hidden_layers - p.dense_layers
        assert len(out.router_logits) == moe_layers, name
        assert all(r.shape == (ids.shape[1], p.num_experts) for r in out.router_logits)
        save_hf_dir(model, tok, tmp_path / name)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert again.config.model_type == p.family
        with torch.no_grad():
            assert torch.equal(out.logits, again(ids).logits), name
    assert hasattr(model.model.layers[1].mlp, "shared_experts")  # tiny-moe-shared, the last
    assert not hasattr(model.model.layers[0].mlp, "experts")  # its dense first layer


def test_an_engine_refuses_before_start_a_model_its_forward_does_not_implement(tmp_path):
    """The serving engine's runner implements full RoPE: a GLM4-MoE with partial rotary (its
    default) is refused by it, and left to the embedded engine (HF modules)."""
    model, tok = build_model("tiny-moe-shared", seed=0)
    model.config.rope_parameters["partial_rotary_factor"] = 0.5
    save_hf_dir(model, tok, tmp_path / "partial")
    for engine, transport in [("serving", "colocated"), ("server", "disk")]:
        cfg = load_config(
            None,
            [
                f"model.path={tmp_path / 'partial'}",
                f"rollout.engine={engine}",
                f"weight_sync.transport={transport}",
                f"checkpoint.root={tmp_path / 'ckpt'}",
                f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            ],
        )
        with pytest.raises(ValueError) as e:
            preflight(cfg)
        assert str(e.value) == (
            f"rollout.engine {engine} cannot run model.path {str(tmp_path / 'partial')!r}: "
            "partial_rotary_factor 0.5 (the runner rotates every dimension)"
        )
    assert not (tmp_path / "ckpt").exists()
    assert ENGINES.get("embedded").refuses(model.config.to_dict()) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, engine", [("tiny-moe", "embedded"), ("tiny-moe-shared", "serving")]
)
def test_rl_steps_train_the_experts_and_routers_and_the_engine_serves_them(
    tmp_path, preset, engine
):
    cfg = load_config(
        None,
        [
            f"model.preset={preset}",
            f"rollout.engine={engine}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.lr=1e-3",
            "train.loss_options.entropy_coef=0.01",  # a gradient whatever the random model's rewards
            f"checkpoint.root={tmp_path / 'ckpt'}",
            "weight_sync.check_equal=true",
        ],
    )
    model_dir = runtime.prepare_model_dir(cfg, tmp_path / "init")
    rt = runtime.RLRuntime(cfg, model_dir, None)
    try:
        before = {n: t.clone() for n, t in rt.trainer.full_state_dict().items()}
        for step in range(2):
            result = rt.rollout(step)
            metrics = rt.train(result)
            assert metrics["train/grad_norm"] > 0 and torch.isfinite(
                torch.tensor(metrics["train/loss"])
            )
            rt.update_weights()  # check_equal: the engine holds the trained weights
        after = rt.trainer.full_state_dict()
        moved = {n for n in before if not torch.equal(before[n], after[n])}
        assert any("experts" in n for n in moved) and any("mlp.gate." in n for n in moved), moved
    finally:
        rt.close()


def _hf_routes(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF forward's last logits and its routers' top-k experts, [B, T, MoE layers, k]."""
    got: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: got.append(out[2]))
        for name, m in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    try:
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
    finally:
        for h in hooks:
            h.remove()
    b, t = ids.shape
    return logits, torch.stack([g.view(b, t, -1) for g in got], dim=2)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_the_serving_runner_computes_the_hf_forward_and_routes_of_moe_models(preset):
    from miles_core.models.qwen3.runner import Qwen3Runner

    model, _ = build_model(preset, seed=1)
    runner = Qwen3Runner(model, slots=2, max_len=64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=gen)
    logits, routes = _hf_routes(model, ids)
    assert (runner.prefill([0, 1], [0, 0], ids.tolist()) - logits).abs().max() < 1e-5
    assert torch.equal(runner.last_routes, routes)  # every token, every MoE layer
    nxt = torch.randint(3, 100, (2, 1), generator=gen)
    logits, routes = _hf_routes(model, torch.cat([ids, nxt], dim=1))
    assert (runner.decode([0, 1], [12, 12], nxt[:, 0].tolist()) - logits).abs().max() < 1e-5
    assert torch.equal(runner.last_routes, routes[:, -1:])


def test_routed_experts_travel_in_sglangs_layout_and_a_misfit_is_refused():
    """base64 of little-endian int32, [tokens − 1, MoE layers, top_k] (SGLang's
    meta_info.routed_experts), built here byte by byte."""
    routes = np.arange(5 * 2 * 2, dtype=np.int64).reshape(5, 2, 2) % 8
    raw = base64.b64encode(struct.pack("<20i", *routes.reshape(-1).tolist())).decode()
    assert moe.encode(routes) == raw
    back = moe.decode(raw, 2, 2)
    assert back.dtype == np.int32 and np.array_equal(back, routes)
    with pytest.raises(ValueError, match=r"not whole rows of \(3, 2\) int32"):
        moe.decode(raw, 3, 2)  # another model's layers


def _sequence_routes(model, ids: list[int]) -> np.ndarray:
    """The HF routers' experts for every position of `ids` but the last: [len − 1, L, k]."""
    _, routes = _hf_routes(model, torch.tensor([ids]))
    return routes[0, :-1].numpy()


def test_the_serving_engine_returns_the_routes_of_every_position_it_processed():
    from miles_core.engines.cpu.serving import ServingEngine
    from miles_core.engines.wire import EngineRequestError, GenerateRequest, SamplingParams

    model, tok = build_model("tiny-moe-shared", seed=1)
    engine = ServingEngine(model, tok, seed=0, max_running=4, scheduler="caller")
    field = moe.routes_field(2, 2)
    prompt = [5, 6, 7, 8, 9, 10]

    def ask(ids: list[int], n: int, routes: bool = True) -> list:
        sp = SamplingParams(max_new_tokens=n, sampling_seed=3)
        req = GenerateRequest(
            input_ids=ids, sampling_params=sp, return_fields=[moe.ROUTES.name] if routes else []
        )
        return engine.generate([req, req.model_copy()])  # siblings: the second reuses the prefix

    first, sibling = ask(prompt, 4)
    assert sibling.meta_info.cached_tokens > 0
    for out in (first, sibling):
        got = moe.decode(out.meta_info.model_extra["routed_experts"], 2, 2)
        assert np.array_equal(got, _sequence_routes(model, prompt + out.output_ids))
    # a continuation (prompt + what was generated, as after a pause-abort) returns every row
    # again; joined as the per-token channel joins them, the rows are the whole trajectory's
    head = moe.decode(first.meta_info.model_extra["routed_experts"], 2, 2)
    more, _ = ask(prompt + first.output_ids, 3)
    whole = field.join(head, field.decode(more.meta_info.model_extra["routed_experts"]))
    ids = prompt + first.output_ids + more.output_ids
    assert whole.shape == (len(ids) - 1, 2, 2)
    assert np.array_equal(whole, _sequence_routes(model, ids))
    plain, _ = ask(prompt, 2, routes=False)
    assert "routed_experts" not in plain.meta_info.model_extra
    dense = ServingEngine(*build_model("tiny", seed=1), seed=0, max_running=2, scheduler="caller")
    with pytest.raises(EngineRequestError, match="no mixture-of-experts layers"):
        dense.validate(GenerateRequest(input_ids=prompt, return_fields=[moe.ROUTES.name]))


@pytest.mark.slow
def test_an_engine_server_returns_routed_experts_over_sglangs_http_api(tmp_path):
    """`return_routed_experts` in SGLang's GenerateReqInput (single and batch form, through our
    client too) → meta_info.routed_experts of every position (a dense model's refusal: the
    in-process test above; the server answers an EngineRequestError with 400)."""
    from miles_core.engines.http import EngineProcess, HttpEngine
    from miles_core.engines.wire import GenerateRequest, SamplingParams
    from miles_core.token_fields import FIELDS

    model, tok = build_model("tiny-moe-shared", seed=1)
    save_hf_dir(model, tok, tmp_path / "moe")
    prompt = [5, 6, 7, 8]
    with EngineProcess(tmp_path / "moe", args=["--threads", "1"]) as proc:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3},
            "return_routed_experts": True,
        }
        out = httpx.post(f"{proc.url}/generate", json=body, timeout=60).json()
        got = moe.decode(out["meta_info"]["routed_experts"], 2, 2)
        assert np.array_equal(got, _sequence_routes(model, prompt + out["output_ids"]))
        batch = {**body, "input_ids": [prompt, prompt[:2]], "return_routed_experts": [False, True]}
        outs = httpx.post(f"{proc.url}/generate", json=batch, timeout=60).json()
        assert "routed_experts" not in outs[0]["meta_info"]
        assert moe.decode(outs[1]["meta_info"]["routed_experts"], 2, 2).shape == (
            2 + 3 - 1,
            2,
            2,
        )
        for bad in (  # a flag per prompt that does not fit, the wrong type: 4xx, never 5xx
            {**batch, "return_routed_experts": [True]},
            {**body, "return_routed_experts": "yes please"},
            {**body, "return_routed_experts": [True, False, None]},
        ):
            r = httpx.post(f"{proc.url}/generate", json=bad, timeout=60)
            assert 400 <= r.status_code < 500, (bad, r.status_code, r.text)
        FIELDS.register("routed_experts", moe.routes_field(2, 2))
        client = HttpEngine(proc.url)
        try:
            sp = SamplingParams(max_new_tokens=3)
            [resp] = client.generate(
                [
                    GenerateRequest(
                        input_ids=prompt, sampling_params=sp, return_fields=[moe.ROUTES.name]
                    )
                ]
            )
            want = _sequence_routes(model, prompt + resp.output_ids)
            assert np.array_equal(resp.token_fields["routed_experts"], want)
            sample = _three_session_turns(proc.url)
            assert np.array_equal(
                sample.token_fields["routed_experts"], _sequence_routes(model, sample.tokens)
            )
            # continued after a pause-abort: the prompt and what was generated, asked again
            ids = prompt + resp.output_ids
            [more] = client.generate(
                [
                    GenerateRequest(
                        input_ids=ids, sampling_params=sp, return_fields=[moe.ROUTES.name]
                    )
                ]
            )
            field = token_field("routed_experts")
            rows = field.join(
                resp.token_fields["routed_experts"], more.token_fields["routed_experts"]
            )
            ids += more.output_ids
            assert np.array_equal(rows, _sequence_routes(model, ids))
            batch = _replay_batch(sample, ids, len(prompt), rows)
            assert _replayed_in_training(tmp_path / "moe", batch)
            assert _replayed_in_megatron(tmp_path / "moe", batch)
        finally:
            client.close()
            FIELDS.unregister("routed_experts")


def _three_session_turns(engine_url: str):
    """A 3-turn chat through the session server (in process, asking for routed experts): the
    trajectory's sample, its rows merged per turn."""
    from fastapi.testclient import TestClient

    from miles_core.sessions.server import create_app
    from miles_core.tito import FAMILIES
    from miles_core.types import sample_from_json

    with TestClient(
        create_app(engine_url, FAMILIES.get("tiny")(), request_fields=[moe.ROUTES.name])
    ) as c:
        sid = c.post("/sessions", json={"rollout_id": "moe-1"}).json()["session_id"]
        messages = [{"role": "user", "content": "count"}]
        for k in range(3):
            r = c.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": messages, "max_tokens": 5, "seed": k},
            )
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]["content"] or ""
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"again {k}"},
            ]
        data = c.post(f"/sessions/{sid}/samples", json={"reward": 1.0}).json()
    [sample] = [sample_from_json(x) for x in data["samples"]]
    assert sample.metadata["turns"] == 3
    return sample


def _replay_batch(sample, ids: list[int], prompt_len: int, rows: np.ndarray):
    """A training batch of two rows: the session's sample, and a sequence continued after a
    pause-abort (`ids`, the routes of its two engine calls joined: `rows`)."""
    from miles_core.train.batch import TrainBatch

    session = TrainBatch.from_samples([sample], [0.0], 1.0)
    n = len(ids) - prompt_len
    return TrainBatch(
        tokens=[*session.tokens, ids],
        response_lengths=[*session.response_lengths, n],
        loss_masks=[*session.loss_masks, [1] * n],
        advantages=[0.0, 0.0],
        token_fields={"routed_experts": [*session.token_fields["routed_experts"], rows]},
    )


def _recorded_masks(batch) -> list[torch.Tensor]:
    """Per row: the recorded experts as a mask [positions, MoE layers, experts]."""
    return [
        torch.nn.functional.one_hot(torch.from_numpy(r).long(), 8).sum(-2).bool()
        for r in batch.token_fields["routed_experts"]
    ]


def _replayed_in_training(model_dir, batch) -> bool:
    """The experts the FSDP2 trainer's expert layers run for every row of `batch` under replay
    equal its recorded routes (every recorded position and MoE layer), with routers perturbed
    so that they would choose apart."""
    from miles_core.train.forward import MicroBatch
    from miles_core.train.routing_replay import RouterReplay

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # other weights than the engine's: the router would choose apart
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    replay = RouterReplay(model, replay=True, check=True)
    used: list[torch.Tensor] = []
    hooks = [
        layer.mlp.experts.register_forward_hook(lambda m, a, o: used.append(a[1]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
    ]
    mb = MicroBatch.build(batch, 0, torch.device("cpu"))
    with torch.no_grad(), replay.micro_batch(mb):
        model(input_ids=mb.padded.input_ids)
    for h in hooks:
        h.remove()
    b, t = mb.padded.input_ids.shape
    chosen = torch.stack([u.view(b, t, -1) for u in used], dim=2)  # [B, T, L, k]
    got = torch.nn.functional.one_hot(chosen, 8).sum(-2).bool()
    assert replay.take_counts()["routing_mismatch_fraction__num"] > 0  # they disagreed
    return all(torch.equal(got[i, : len(m)], m) for i, m in enumerate(_recorded_masks(batch)))


def _replayed_in_megatron(model_dir, batch) -> bool:
    """The same through the Megatron backend (one rank, in this process): its routers' routing
    maps under replay (Megatron's RouterReplay hook), in its sequence-first token order."""
    from miles_core.config import RunConfig
    from miles_core.train.backend import BACKENDS
    from miles_core.train.backends.megatron.routing_replay import replay_hooks

    cfg = RunConfig().train.model_copy(
        update={"micro_batch_size": 2, "routing_replay": True, "check_routing_replay": True}
    )
    settings = cfg.model_dump()
    trainer = BACKENDS.get("megatron")(model_dir=str(model_dir), optim=settings, loss=settings)
    try:
        routers = replay_hooks(trainer.model)
        used: list[torch.Tensor] = []
        with torch.no_grad():
            for r in routers:
                r.weight.add_(torch.randn_like(r.weight))
        hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1])) for r in routers]
        trainer.compute_log_probs(batch)
        for h in hooks:
            h.remove()
        apart, checked = trainer.routing.totals
    finally:
        from megatron.core import parallel_state

        trainer.close()
        parallel_state.destroy_model_parallel()  # no process groups left for later tests
    assert apart > 0 and checked == sum(len(m) for m in _recorded_masks(batch)) * len(routers)
    t = max(len(x) for x in batch.tokens)
    got = torch.stack([u.view(t, len(batch), -1).transpose(0, 1) for u in used], dim=2)
    return all(torch.equal(got[i, : len(m)], m) for i, m in enumerate(_recorded_masks(batch)))


@pytest.mark.slow
def test_with_routing_replay_the_trainer_routes_every_token_as_the_engine_did(tmp_path):
    """A bf16 engine against the fp32 trainer (a real perturbation): the checker measures how
    often the trainer's routers would choose apart, and with replay the experts the trainer's
    expert layers actually run are the engine's recorded ones, every position and layer."""
    cfg = load_config(
        None,
        [
            "model.preset=tiny-moe-shared",
            "rollout.engine=serving",
            "weight_sync.transport=colocated",
            "rollout.engine_options.dtype=bfloat16",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "train.routing_replay=true",
            "train.check_routing_replay=true",
            f"checkpoint.root={tmp_path / 'ckpt'}",
        ],
    )
    assert moe.PATH in cfg.rollout.token_fields  # asked of the engine by the trainer's settings
    model_dir = runtime.prepare_model_dir(cfg, tmp_path / "init")
    rt = runtime.RLRuntime(cfg, model_dir, None)
    seen: dict[str, list[torch.Tensor]] = {"ids": [], "experts": []}
    model = rt.trainer.model
    hooks = [
        model.model.embed_tokens.register_forward_hook(
            lambda mod, args, out: seen["ids"].append(args[0])
        ),
        *(
            layer.mlp.experts.register_forward_hook(
                lambda mod, args, out: seen["experts"].append(args[1])
            )
            for layer in model.model.layers
            if hasattr(layer.mlp, "experts")
        ),
    ]
    try:
        result = rt.rollout(0)
        metrics = rt.train(result)
    finally:
        for h in hooks:
            h.remove()
        rt.close()
    assert 0.0 <= metrics["train/routing_mismatch_fraction"] <= 1.0
    [ids] = seen["ids"]  # one training forward: [B, T]
    b, t = ids.shape
    used = torch.stack([e.view(b, t, -1) for e in seen["experts"]], dim=2)  # [B, T, L, k]
    checked = 0
    for row, sample in zip(ids.tolist(), result.samples, strict=True):
        assert row[: len(sample.tokens)] == sample.tokens
    for i, sample in enumerate(result.samples):
        recorded = torch.from_numpy(sample.token_fields["routed_experts"]).long()
        n = len(sample.tokens) - 1
        assert recorded.shape == (n, 2, 2)
        assert torch.equal(used[i, :n], recorded)
        checked += n
    assert checked > 0


def test_routing_replay_on_a_dense_model_or_an_engine_that_records_nothing_is_refused(tmp_path):
    base = [
        f"checkpoint.root={tmp_path / 'ckpt'}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "train.routing_replay=true",
    ]
    dense = load_config(None, [*base, "model.preset=tiny", "rollout.engine=serving"])
    with pytest.raises(ValueError) as e:
        preflight(dense)
    assert str(e.value) == (
        f"rollout.token_fields {moe.PATH}: model.preset: routing replay records each token's "
        "experts: the model has no mixture-of-experts layers (train.routing_replay and "
        "train.check_routing_replay need an MoE model)"
    )
    embedded = load_config(None, [*base, "model.preset=tiny-moe", "rollout.engine=embedded"])
    refused = "rollout.engine embedded cannot run model.preset: it does not fill token field "
    with pytest.raises(ValueError, match=refused + "routed_experts"):
        preflight(embedded)
    assert not (tmp_path / "ckpt").exists()


def test_a_routing_record_that_does_not_fit_the_model_fails_its_sample_not_the_step():
    """A real engine's record of tiny-moe-shared (2 MoE layers, top-2 of 8) parsed by a run of
    another shape: the response parses, the sample is FAILED with the reason, nothing trains."""
    from miles_core.data import TASKS
    from miles_core.data.tasks import Example
    from miles_core.engines.cpu.serving import ServingEngine
    from miles_core.engines.wire import GenerateRequest, GenerateResponse, SamplingParams
    from miles_core.rollout.rollout_fn import build_group
    from miles_core.types import Status

    model, tok = build_model("tiny-moe-shared", seed=1)
    engine = ServingEngine(model, tok, seed=0, max_running=2, scheduler="caller")
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(max_new_tokens=4, sampling_seed=1)
    [resp] = engine.generate(
        [GenerateRequest(input_ids=prompt, sampling_params=sp, return_fields=[moe.ROUTES.name])]
    )
    raw = resp.model_dump_json()
    small = preset_config("small-moe", len(tok), tok.pad_token_id, tok.eos_token_id)
    other_experts = model.config.to_dict() | {"n_routed_experts": 4}  # same shape, 4 experts
    task = TASKS.get("say_a")
    try:
        for config, why in [
            (small.to_dict(), "routed_experts"),  # 4 MoE layers: rows of another size
            (other_experts, "outside [0, 4)"),  # indices this model does not have
        ]:
            declare_for_model([moe.PATH], config)
            parsed = GenerateResponse.model_validate_json(raw)
            assert parsed.field_error and why in parsed.field_error, parsed.field_error
            assert parsed.token_fields == {} and parsed.output_ids == resp.output_ids
            [sample] = build_group(task, 0, 0, 1, 0, Example("x", None), prompt, [parsed]).samples
            assert sample.status == Status.FAILED and not any(sample.loss_mask)
            assert "per-token record was refused" in sample.metadata["error"]
        declare_for_model([moe.PATH], model.config.to_dict())  # the right model: it fits
        assert GenerateResponse.model_validate_json(raw).field_error is None
    finally:
        FIELDS.unregister("routed_experts")


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_replaying_the_routers_own_choice_reproduces_their_forward_and_gradients(preset):
    """Each family's weight rule (softmax; sigmoid with the correction bias choosing, never
    weighing) gives the chosen experts the weights the router itself gives them: replaying the
    natural routes leaves logits and router gradients as they are."""
    from miles_core.train.batch import TrainBatch
    from miles_core.train.forward import MicroBatch
    from miles_core.train.routing_replay import RouterReplay, routers_of

    model, _ = build_model(preset, seed=2)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    _, natural = _hf_routes(model, ids)  # [B, T, L, k]
    declare_for_model([moe.PATH], model.config.to_dict())
    batch = TrainBatch(
        tokens=ids.tolist(),
        response_lengths=[3, 3],
        loss_masks=[[1] * 3] * 2,
        token_fields={"routed_experts": [r[:-1].numpy().astype(np.int32) for r in natural]},
    )
    mb = MicroBatch.build(batch, 0, torch.device("cpu"))

    def forward_and_grads(replay: RouterReplay | None):
        model.zero_grad()
        if replay is None:
            logits = model(input_ids=ids).logits
        else:
            with replay.micro_batch(mb):
                logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), [r.weight.grad.clone() for r in routers_of(model)]

    plain, plain_grads = forward_and_grads(None)
    replay = RouterReplay(model, replay=True, check=True)
    again, again_grads = forward_and_grads(replay)
    assert (again - plain).abs().max() < 1e-6
    for a, b in zip(plain_grads, again_grads, strict=True):
        assert a.abs().max() > 0 and torch.allclose(a, b, atol=1e-7)
    assert replay.take_counts()["routing_mismatch_fraction__num"] == 0


@pytest.mark.slow
def test_every_transport_pushes_moe_weights_bitwise_and_the_engine_routes_with_them(tmp_path):
    """Expert tensors are 3-D ([experts, 2·width, hidden]); every transport delivers them bitwise
    to an MoE engine server (p2p from two ranks that split every tensor along dim 1), and the
    engine's routes after a push are those of the pushed weights."""
    from test_transports import _TwoRankShards

    from miles_core.engines.http import EngineProcess, HttpEngine
    from miles_core.engines.wire import GenerateRequest, SamplingParams
    from miles_core.token_fields import FIELDS
    from miles_core.weights import TRANSPORTS, weights_checksum
    from miles_core.weights.source import TensorBuckets
    from miles_core.weights.transports.disk import DiskTransport

    model, tok = build_model("tiny-moe-shared", seed=1)
    model_dir = save_hf_dir(model, tok, tmp_path / "moe")
    FIELDS.register("routed_experts", moe.routes_field(2, 2, 8))
    gen = torch.Generator().manual_seed(0)

    def new_weights() -> dict[str, torch.Tensor]:
        return {
            n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters()
        }

    with EngineProcess(model_dir, args=["--threads", "1"], weight_roots=[tmp_path]) as proc:
        engine = HttpEngine(proc.url)
        try:
            for version, name in enumerate(["shared_memory", "disk", "broadcast", "p2p"], 1):
                if name == "disk":
                    transport = DiskTransport(root=str(tmp_path / "w"), keep=1)
                else:
                    transport = TRANSPORTS.get(name)()
                transport.connect([engine])
                weights = new_weights()
                source = _TwoRankShards(weights) if name == "p2p" else TensorBuckets(weights, per=3)
                try:
                    transport.push(source, version=version)
                finally:
                    getattr(transport, "close", lambda: None)()
                assert engine.weights_checksum() == weights_checksum(weights.items()), name
                assert engine.weight_version == version
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])  # the HF model now holds the last push
            sp = SamplingParams(max_new_tokens=4, sampling_seed=3)
            [resp] = engine.generate(
                [
                    GenerateRequest(
                        input_ids=[5, 6, 7, 8], sampling_params=sp, return_fields=[moe.ROUTES.name]
                    )
                ]
            )
            want = _sequence_routes(model, [5, 6, 7, 8] + resp.output_ids)
            assert np.array_equal(resp.token_fields["routed_experts"], want)
        finally:
            engine.close()
