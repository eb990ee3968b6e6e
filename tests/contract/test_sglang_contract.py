"""Our engine client and server against SGLang's own request structures.

`sglang_api.json` holds the field names of SGLang's request structs (`io_struct.py`), its
SamplingParams fields and its HTTP routes, extracted from the sglang wheel by
`sync_sglang_contract.py` (re-run it when the GPU hosts move to a new SGLang).
"""

import json
from pathlib import Path

import httpx
import pytest

from miles_core.engines.cpu.lora_routes import LoadLoraBody, LoraTensorsBody, UnloadLoraBody
from miles_core.engines.cpu.server import (
    AbortBody,
    CheckerBody,
    DiskBody,
    DistributedBody,
    GenerateBody,
    GroupBody,
    MemoryBody,
    PauseBody,
    TensorBody,
    VersionBody,
    create_app,
)
from miles_core.engines.http import batch_payload, generate_payload
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.models import moe
from miles_core.token_fields import FIELDS

API = json.loads((Path(__file__).with_name("sglang_api.json")).read_text())
STRUCTS = API["structs"]


def test_the_contract_file_is_for_a_known_sglang():
    assert API["sglang_version"] == "0.5.23"
    assert len(STRUCTS["GenerateReqInput"]) > 50 and "input_ids" in STRUCTS["GenerateReqInput"]


def test_the_generate_payload_uses_sglang_field_names():
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        rid="r1",
        sampling_params=SamplingParams(
            max_new_tokens=4,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            stop_token_ids=[3],
            sampling_seed=1,
        ),
    )
    single = generate_payload(req)
    assert set(single) <= set(STRUCTS["GenerateReqInput"])
    assert set(single["sampling_params"]) <= set(API["sampling_params"])
    payload = batch_payload([req, req.model_copy(update={"rid": "r2"})])
    assert set(payload) <= set(STRUCTS["GenerateReqInput"])
    assert payload["rid"] == ["r1", "r2"] and payload["input_ids"] == [[1, 2, 3]] * 2
    for params in payload["sampling_params"]:
        assert set(params) <= set(API["sampling_params"])
    # prompt scoring (a distillation teacher's request): SGLang's fields, unless a temperature
    # other than SGLang's fixed 1 is asked for (our extension, which a real SGLang never gets)
    scoring = req.model_copy(update={"logprob_start_len": 2, "input_logprob_temperature": 1.0})
    assert "logprob_start_len" in STRUCTS["GenerateReqInput"]
    assert set(generate_payload(scoring)) <= set(STRUCTS["GenerateReqInput"])
    assert set(batch_payload([req, scoring])) <= set(STRUCTS["GenerateReqInput"])
    # MoE routing replay: the routes field's request flag is SGLang's GenerateReqInput field, in
    # both forms
    flag = moe.ROUTES.request_flag
    before = FIELDS.get(moe.ROUTES.name) if moe.ROUTES.name in FIELDS else None  # a run's
    if before is not None:
        FIELDS.unregister(moe.ROUTES.name)
    FIELDS.register(moe.ROUTES.name, moe.routes_field(2, 2))
    try:
        routed = req.model_copy(update={"return_fields": [moe.ROUTES.name]})
        assert flag in STRUCTS["GenerateReqInput"]
        assert generate_payload(routed)[flag] is True
        batch = batch_payload([req, routed])
        assert set(batch) <= set(STRUCTS["GenerateReqInput"])
        assert batch[flag] == [False, True]
    finally:
        FIELDS.unregister(moe.ROUTES.name)
        if before is not None:
            FIELDS.register(moe.ROUTES.name, before)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (GenerateBody, "GenerateReqInput"),
        (AbortBody, "AbortReq"),
        (PauseBody, "PauseGenerationReqInput"),
        (VersionBody, "UpdateWeightVersionReqInput"),
        (DiskBody, "UpdateWeightFromDiskReqInput"),
        (TensorBody, "UpdateWeightsFromTensorReqInput"),
        (GroupBody, "InitWeightsUpdateGroupReqInput"),
        (DistributedBody, "UpdateWeightsFromDistributedReqInput"),
        (MemoryBody, "ReleaseMemoryOccupationReqInput"),
        (CheckerBody, "CheckWeightsReqInput"),
        (LoadLoraBody, "LoadLoRAAdapterReqInput"),
        (UnloadLoraBody, "UnloadLoRAAdapterReqInput"),
        (LoraTensorsBody, "LoadLoRAAdapterFromTensorsReqInput"),
    ],
)
def test_server_request_bodies_are_subsets_of_sglang_structs(ours, theirs):
    """Every field is SGLang's, except the extensions a body declares as its own (p2p's
    placement plan), which SGLang never sends and our server reads only for its own format."""
    extensions = getattr(ours, "extensions", frozenset())
    assert extensions.isdisjoint(STRUCTS[theirs]), extensions & set(STRUCTS[theirs])
    fields = set(ours.model_fields) - extensions
    assert fields <= set(STRUCTS[theirs]), fields - set(STRUCTS[theirs])


def test_sampling_params_fields_exist_in_sglang():
    assert set(SamplingParams.model_fields) <= set(API["sampling_params"])


def test_every_route_we_serve_exists_in_sglang(tiny):
    from miles_core.engines.cpu.serving import ServingEngine

    model, tok = tiny
    engine = ServingEngine(model, tok, max_running=2, cache_slots=2)
    try:
        app = create_app(engine)
        ours = {
            r.path
            for r in app.routes
            if hasattr(r, "methods") and not r.path.startswith(("/openapi", "/docs"))
        }
    finally:
        engine.close()
    assert ours <= set(API["routes"]), ours - set(API["routes"])


@pytest.fixture(scope="module")
def server(tiny_dir):
    """One engine server for the tests below that only send it requests."""
    from miles_core.engines.http import EngineProcess

    with EngineProcess(tiny_dir, args=["--threads", "1"]) as proc:
        yield proc


def test_an_sglang_style_request_with_fields_we_do_not_use_is_accepted(server):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 2,
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "min_p": 0.0,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_routed_experts": False,
        "routing_key": "session-1",
        "rid": "sgl-1",
    }
    assert set(body) <= set(STRUCTS["GenerateReqInput"])
    r = httpx.post(f"{server.url}/generate", json=body)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["id"] == "sgl-1" and len(meta["output_token_logprobs"]) == 2
    assert {
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
    } <= set(meta)


def test_sglang_launch_flags_are_sglang_server_args():
    from miles_core.engines.sglang import SGLangLaunch

    launch = SGLangLaunch(
        python="/opt/sglang/bin/python",
        model_path="/ckpt/policy",
        port=30001,
        tp_size=2,
        ep_size=2,  # experts over the same GPUs (miles plan's engine layout)
        context_length=4096,
        mem_fraction_static=0.7,
        max_running_requests=128,
        random_seed=1,
        enable_memory_saver=True,
        extra_args=["--enable-return-routed-experts"],  # MoE routes (models/moe.py)
    ).serve_adapters(  # a LoRA run's adapters (lora/adapter.py: engine_spec)
        {
            "adapters": {
                "a": {"r": 8, "target_modules": ["model.layers.0.self_attn.q_proj", "lm_head"]},
                "b": {"r": 16, "target_modules": ["model.layers.1.mlp.down_proj"]},
            },
            "max_loaded": 8,
        }
    )
    cmd = launch.command()
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert (
        cmd[cmd.index("--model-path") + 1] == "/ckpt/policy"
        and cmd[cmd.index("--tp-size") + 1] == "2"
        and cmd[cmd.index("--ep-size") + 1] == "2"
    )
    flags = [a[2:].replace("-", "_") for a in cmd if a.startswith("--")]
    assert set(flags) <= set(API["server_args"]), set(flags) - set(API["server_args"])
    assert {"enable_memory_saver", "enable_return_routed_experts", "skip_tokenizer_init"} <= set(
        flags
    )
    assert {"enable_lora", "max_lora_rank", "lora_target_modules", "max_loaded_loras"} <= set(flags)
    modules = cmd.index("--lora-target-modules")
    assert cmd[modules + 1 : modules + 4] == ["down_proj", "lm_head", "q_proj"]
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert cmd[cmd.index("--max-loaded-loras") + 1] == "8"


def test_attach_to_running_servers_by_address(server, tiny_dir):
    from miles_core.engines.http import EngineUnavailable
    from miles_core.engines.sglang import attach
    from miles_core.processes.ports import free_port

    (engine,) = attach([server.url], expected_model=str(tiny_dir))
    out = engine.generate(
        [GenerateRequest(input_ids=[5, 6], sampling_params=SamplingParams(max_new_tokens=2))]
    )
    assert len(out[0].output_ids) == 2
    with pytest.raises(ValueError, match="expected '/elsewhere'"):
        attach([server.url], expected_model="/elsewhere")
    with pytest.raises(EngineUnavailable, match="cannot attach"):  # nothing listens there
        attach([f"http://127.0.0.1:{free_port()}"], timeout=2)


@pytest.mark.gpu
def test_real_sglang_server_answers_our_client():
    """Runs where SGLANG_PYTHON names the interpreter of an SGLang environment and
    SGLANG_MODEL a model directory (a GPU host)."""
    import os

    from miles_core.engines.sglang import SGLangLaunch, SGLangProcess, attach

    python, model = os.environ.get("SGLANG_PYTHON"), os.environ.get("SGLANG_MODEL")
    if not python or not model:
        pytest.skip("set SGLANG_PYTHON and SGLANG_MODEL to run against a real SGLang server")
    proc = SGLangProcess(SGLangLaunch(python=python, model_path=model)).start()
    try:
        (engine,) = attach([proc.url])
        out = engine.generate(
            [GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4))]
        )
        assert len(out[0].output_ids) == 4 and len(out[0].output_log_probs) == 4
    finally:
        proc.stop()


def test_an_sglang_server_that_was_never_updated_reports_version_zero():
    from miles_core.engines.wire import MetaInfo, version_number

    assert version_number("default") == 0  # SGLang's initial weight_version
    assert version_number("7") == 7
    with pytest.raises(ValueError, match="'v5' is neither an integer policy version"):
        version_number("v5")
    meta = MetaInfo(
        finish_reason={"type": "stop"},
        prompt_tokens=1,
        completion_tokens=1,
        weight_version="default",
    )
    assert meta.version == 0


def test_the_sglang_engine_refuses_a_launch_without_its_interpreter(tmp_path):
    """`rollout.engine: sglang` launches SGLang from its own environment; a wrong interpreter is a
    clear error before anything starts (and nothing is left running)."""
    from miles_core.config import RolloutConfig
    from miles_core.engines.registry import ENGINES, EngineSetup

    kind = ENGINES.get("sglang")
    python = str(tmp_path / "no-env" / "bin" / "python")
    setup = EngineSetup(
        RolloutConfig(),
        None,
        None,
        tmp_path,
        0,
        tmp_path,
        options=kind.Options(python=python),
    )
    with pytest.raises(FileNotFoundError, match=f"SGLang interpreter '{python}' not found"):
        kind.build(setup)
