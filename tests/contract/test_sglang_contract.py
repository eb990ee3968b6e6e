"""Our engine client and server against SGLang's own request structures.

`sglang_api.json` holds the field names of SGLang's request structs (`io_struct.py`), its
SamplingParams fields and its HTTP routes, extracted from the sglang wheel by
`sync_sglang_contract.py` (re-run it when the GPU hosts move to a new SGLang).
"""

import json
from pathlib import Path

import httpx
import pytest

from miles_core.rollout.http_engine import generate_payload
from miles_core.rollout.protocol import GenerateRequest, SamplingParams
from miles_core.rollout.server import (
    AbortBody,
    CheckerBody,
    DiskBody,
    GenerateBody,
    MemoryBody,
    PauseBody,
    VersionBody,
    create_app,
)

API = json.loads((Path(__file__).with_name("sglang_api.json")).read_text())
STRUCTS = API["structs"]


def test_the_contract_file_is_for_a_known_sglang():
    assert API["sglang_version"] == "0.5.23"
    assert len(STRUCTS["GenerateReqInput"]) > 50 and "input_ids" in STRUCTS["GenerateReqInput"]


def test_generate_payload_uses_sglang_field_names():
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
    payload = generate_payload(req)
    assert set(payload) <= set(STRUCTS["GenerateReqInput"])
    assert set(payload["sampling_params"]) <= set(API["sampling_params"])


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (GenerateBody, "GenerateReqInput"),
        (AbortBody, "AbortReq"),
        (PauseBody, "PauseGenerationReqInput"),
        (VersionBody, "UpdateWeightVersionReqInput"),
        (DiskBody, "UpdateWeightFromDiskReqInput"),
        (MemoryBody, "ReleaseMemoryOccupationReqInput"),
        (CheckerBody, "CheckWeightsReqInput"),
    ],
)
def test_server_request_bodies_are_subsets_of_sglang_structs(ours, theirs):
    assert set(ours.model_fields) <= set(STRUCTS[theirs]), set(ours.model_fields) - set(
        STRUCTS[theirs]
    )


def test_sampling_params_fields_exist_in_sglang():
    assert set(SamplingParams.model_fields) <= set(API["sampling_params"])


def test_every_route_we_serve_exists_in_sglang(tiny):
    from miles_core.rollout.serving import ServingEngine

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


def test_an_sglang_style_request_with_fields_we_do_not_use_is_accepted(tiny_dir):
    from miles_core.rollout.http_engine import EngineProcess

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
    with EngineProcess(tiny_dir, args=["--threads", "1"]) as proc:
        r = httpx.post(f"{proc.url}/generate", json=body)
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
