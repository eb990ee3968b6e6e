"""The OpenEnv adapter against a real `openenv-core` environment server (examples/openenv_words,
a subprocess on 127.0.0.1 speaking OpenEnv's WebSocket protocol): the environment's rewards and
`done` drive the episode; through the session server every turn is recorded as token ids, the
environment's observations as context (loss mask 0); a missing or unreachable environment fails
the episode with a clear reason."""

import asyncio
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI

pytest.importorskip("openenv.core", reason="openenv-core is an optional extra: .[openenv]")

from test_agents import _Server  # noqa: E402

from miles_core.agents.layers import GenerateInput  # noqa: E402
from miles_core.agents.session_generate import session_generate  # noqa: E402
from miles_core.envs.openenv_agent import run_agent  # noqa: E402
from miles_core.processes.managed import ManagedProcess, free_port  # noqa: E402
from miles_core.types import Status  # noqa: E402

SERVER = Path(__file__).parents[1] / "examples" / "openenv_words" / "server.py"


class WordsEnv(ManagedProcess):
    what = "OpenEnv words server"

    def command(self) -> list[str]:
        return [sys.executable, str(SERVER), "--port", str(self.port)]


@pytest.fixture(scope="module")
def env_url(tmp_path_factory):
    with WordsEnv(log_path=tmp_path_factory.mktemp("openenv") / "env.log") as env:
        yield env.url


def _policy(first_wrong: bool) -> FastAPI:
    """Says the asked word, after one wrong answer when `first_wrong`; always wrong if the
    word is "never"."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        ask = body["messages"][-1]["content"]
        word = ask.rsplit(" ", 1)[-1]
        replies = sum(m["role"] == "assistant" for m in body["messages"])
        wrong = word == "never" or (first_wrong and replies == 0)
        message = {"role": "assistant", "content": "xyz" if wrong else word}
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }

    return app


def _episode(base_url, env_url, word, max_turns=4, prompt=()):
    task = {"env_url": env_url, "reset": {"word": word, "max_tries": 3}}
    return asyncio.run(
        run_agent(base_url, list(prompt), {}, {"task": task, "max_turns": max_turns})
    )


def test_the_environment_sets_reward_and_ends_the_episode(env_url):
    with _Server(_policy(first_wrong=False)) as url:
        out = _episode(url, env_url, "cat")
    assert out == {"reward": 1.0, "metrics": {"turns": 1.0, "env_steps": 1.0, "env_done": 1.0}}
    with _Server(_policy(first_wrong=True)) as url:
        out = _episode(url, env_url, "dog")
    assert out["reward"] == 1.0 and out["metrics"]["turns"] == 2.0  # wrong, then right
    with _Server(_policy(first_wrong=False)) as url:
        out = _episode(url, env_url, "never")  # the environment gives up after max_tries
        assert out["reward"] == 0.0 and out["metrics"] == {
            "turns": 3.0,
            "env_steps": 3.0,
            "env_done": 1.0,
        }
        out = _episode(url, env_url, "never", max_turns=2)  # our turn limit comes first
        assert out["metrics"] == {"turns": 2.0, "env_steps": 2.0, "env_done": 0.0}


def test_an_openenv_episode_through_the_session_server_records_every_turn(
    session_stack, env_url, tiny
):
    _, tok = tiny
    _, sessions = session_stack
    inp = GenerateInput(
        prompt=[{"role": "user", "content": "say cat"}],  # the same as the first observation
        metadata={"task": {"env_url": env_url, "reset": {"word": "cat"}}, "max_turns": 2},
        request_kwargs={"max_tokens": 8, "temperature": 1.0, "seed": 3},
        rollout_id="oe-0",
        session_url=sessions.url,
    )
    out = asyncio.run(session_generate(inp, run_agent))
    assert out.error is None
    assert out.reward == 0.0 and out.metrics["turns"] == 2.0  # a random model: wrong twice
    (sample,) = out.samples  # append-only: one leaf
    sample.validate()
    text = tok.decode(sample.tokens)
    assert text.count("say cat") == 2  # the prompt once (not repeated), then "no: say cat"
    # the environment's second observation is context: it lies under loss mask 0
    start = len(sample.tokens) - sample.response_length
    feedback = tok.encode("no: say cat", add_special_tokens=False)
    at = next(
        i for i in range(len(sample.tokens)) if sample.tokens[i : i + len(feedback)] == feedback
    )
    assert at >= start and not any(sample.loss_mask[at - start : at - start + len(feedback)])
    assert sum(sample.loss_mask) > 0  # the two replies


def test_a_missing_or_unreachable_environment_fails_the_episode(session_stack, monkeypatch):
    _, sessions = session_stack
    monkeypatch.delenv("MILES_OPENENV_URL", raising=False)
    for task, reason in (
        ({"reset": {"word": "cat"}}, "no OpenEnv server: set the task's 'env_url'"),
        ({"env_url": f"http://127.0.0.1:{free_port()}"}, "Failed to connect"),
    ):
        inp = GenerateInput(
            prompt=[{"role": "user", "content": "say cat"}],
            metadata={"task": task, "max_turns": 2},
            request_kwargs={"max_tokens": 4},
            rollout_id="oe-bad",
            session_url=sessions.url,
        )
        out = asyncio.run(session_generate(inp, run_agent))
        assert out.error is not None and reason in out.error
        assert all(s.status == Status.FAILED for s in out.samples)


def test_observation_text_picks_the_text_or_says_what_is_missing():
    from miles_core.envs.openenv_agent import observation_text

    assert observation_text({"prompt": "say cat"}, None) == "say cat"
    assert observation_text({"a": 1, "b": "x"}, None) == '{"a": 1, "b": "x"}'
    assert observation_text({"a": 1, "b": "x"}, "b") == "x"
    with pytest.raises(ValueError, match="the observation has no field 'c'"):
        observation_text({"a": 1}, "c")
