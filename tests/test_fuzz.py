"""Schema fuzzing of every HTTP surface we serve: for each operation of a server's OpenAPI schema,
schemathesis draws requests that follow the schema (positive) and requests that break it
(negative: wrong types, missing fields, out-of-range values), sends them to the real server
subprocess on 127.0.0.1, and every answer must be below 500. Afterwards the server is healthy
and still does its job (a generation, a session turn, an evaluation job accepted).

Bounded: `EXAMPLES` per operation and mode (hypothesis, no example database, no shrinking
phase), each call with a timeout. The figures (requests, 5xx) are printed per server.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from miles_core.models import build_model, save_hf_dir

EXAMPLES = 12  # per operation and generation mode
CALL_TIMEOUT_S = 20


def fuzz(url: str, live: Callable[[], dict[str, str]] | None = None) -> collections.Counter:
    """Every operation of the server at `url`, positive and negative: a Counter of status
    classes ('2xx', '4xx', ...) and `requests`; any 5xx fails. `live()` gives path parameters
    of a live resource (a new session), so operations on `/sessions/{sid}/...` reach past the
    404 of a random id."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fixed = live() if live is not None and "{" in op.path else None
            try:
                _examples(url, op, mode, fixed, counts, failures)()
            except Unsatisfiable:  # nothing to break in a request without parameters
                counts["operations_without_negative_cases"] += 1
        if op.method.upper() in ("POST", "PUT"):  # also bodies the schema does not describe
            fixed = live() if live is not None and "{" in op.path else {}
            path = op.path.format(**fixed) if fixed else op.path
            if "{" not in path:
                _raw_bodies(f"{url}{path}", op.method.upper(), counts, failures)()
    print(f"{url}: {dict(counts)}, {len(failures)} 5xx")
    assert not failures, "\n".join(failures[:20])
    return counts


def _examples(url, op, mode, fixed, counts, failures) -> Callable[[], None]:
    """The hypothesis test of one operation in one mode: `EXAMPLES` requests, counted."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests on every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(op.as_strategy(generation_mode=mode, path_parameters=fixed))
    def run(case) -> None:
        response = case.call(base_url=url, timeout=CALL_TIMEOUT_S)
        counts["requests"] += 1
        counts[f"{response.status_code // 100}xx"] += 1
        if response.status_code >= 500:
            failures.append(
                f"{op.method.upper()} {op.path} {mode.value}: {response.status_code} "
                f"for body {case.body!r:.300} → {response.text[:300]}"
            )

    return run


FIELD_NAMES = [
    "input_ids", "text", "sampling_params", "rid", "messages", "role", "content", "tools",
    "max_tokens", "temperature", "reward", "metadata", "rollout_id", "task", "checkpoint_uri",
    "prompts", "version", "path", "load_format", "named_tensors", "group_name", "world_size",
    "master_address", "master_port", "mode", "abort_all", "weight_version", "tags",
    "return_routed_experts", "return_token_versions", "logprob_start_len",
    "input_logprob_temperature", "lora_path", "return_logprob", "top_logprobs_num",
    "token_ids_logprob",
]  # fmt: skip

# any JSON value, nested up to a few levels (strings with any code point, big and tiny numbers)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_RAW = st.one_of(
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(  # objects with the field names our routes read, holding anything
        st.sampled_from(FIELD_NAMES), _JSON, max_size=6
    ).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [
            b"",
            b"{",
            b"NaN",
            b'{"reward": NaN}',
            b'{"metadata": {"a": Infinity}}',
            b"1e999",
            b"[" * 50_000 + b"]" * 50_000,  # nesting deeper than any parser's recursion
            b'{"a": "\\ud800"}',
            "\u00ff".encode("latin-1"),  # not UTF-8
            b"\x00" * 64,
        ]
    ),
    st.binary(max_size=64),
)


def _raw_bodies(url: str, method: str, counts, failures) -> Callable[[], None]:
    """`EXAMPLES` bodies of any shape (malformed JSON, NaN, deep nesting, not UTF-8) sent to
    one route, with and without a JSON content type."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_RAW, st.booleans())
    def run(body: bytes, as_json: bool) -> None:
        headers = {"content-type": "application/json" if as_json else "text/plain"}
        r = httpx.request(method, url, content=body, headers=headers, timeout=CALL_TIMEOUT_S)
        counts["requests"] += 1
        counts[f"{r.status_code // 100}xx"] += 1
        if r.status_code >= 500:
            failures.append(
                f"{method} {url} raw: {r.status_code} for {body[:200]!r} → {r.text[:300]}"
            )

    return run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model, tok = build_model("tiny", seed=0)
    return save_hf_dir(model, tok, tmp_path_factory.mktemp("fuzz") / "model")


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    """An engine server of its own: the fuzzer pauses it, releases its memory, loads weights
    and adapters (it serves one, declared; requests may name it or none)."""
    import json

    from miles_core.config.lora import LoraSettings
    from miles_core.engines.http import EngineProcess
    from miles_core.lora.adapter import engine_spec
    from miles_core.models import load_hf_dir

    spec = engine_spec(LoraSettings(rank=2), load_hf_dir(model_dir)[0]) | {"required": False}
    args = ["--threads", "1", "--lora", json.dumps(spec)]
    logs = tmp_path_factory.mktemp("fuzz-engine")
    with EngineProcess(model_dir, args=args, log_path=logs / "engine.log") as e:
        yield e


def _generates(url: str) -> list[int]:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.slow  # an engine server of its own (≈20 s to start on 2 busy cores), then ~250 requests
def test_the_engine_server_answers_every_fuzzed_request_below_500(engine):
    before = _generates(engine.url)
    counts = fuzz(engine.url)
    assert counts["requests"] > 200 and counts["4xx"] > 0
    # healthy afterwards, and back to serving: the fuzzer may have paused it or released memory
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
    httpx.post(f"{engine.url}/continue_generation", json={}, timeout=10)
    httpx.post(f"{engine.url}/resume_memory_occupation", json={}, timeout=10)
    assert len(_generates(engine.url)) == len(before)


def test_the_session_server_answers_every_fuzzed_request_below_500(engine, tmp_path):
    from miles_core.sessions import SessionServerProcess

    with SessionServerProcess(engine.url, "tiny", log_path=tmp_path / "sessions.log") as s:

        def new_session() -> dict[str, str]:
            r = httpx.post(f"{s.url}/sessions", json={}, timeout=10)
            assert r.status_code == 201, r.text
            return {"sid": r.json()["session_id"]}

        counts = fuzz(s.url, live=new_session)
        assert counts["requests"] >= 40 and counts["4xx"] > 0
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        sid = new_session()["sid"]  # and a turn still works
        turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{s.url}/sessions/{sid}/v1/chat/completions", json=turn, timeout=60)
        assert r.status_code == 200, r.text


def test_the_evaluation_service_answers_every_fuzzed_request_below_500(tmp_path):
    from miles_core.eval.service import EvalServiceProcess

    with EvalServiceProcess(log_path=tmp_path / "eval.log", checkpoint_roots=[str(tmp_path)]) as s:
        counts = fuzz(s.url)
        assert counts["requests"] > 20 and counts["4xx"] > 0
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
