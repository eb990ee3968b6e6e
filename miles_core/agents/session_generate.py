"""The default generate function: one agent episode recorded by the session server.

It opens a session, hands the agent `base_url = <server>/sessions/<id>/v1`, waits for it (under
a timeout), then collects the session's samples (one per trajectory leaf) with the reward the
environment set. An agent that raises or times out still yields its recorded turns, marked
FAILED with the reason; the session is always closed.

With a key (`GenerateInput.api_key`) every call carries `Authorization: Bearer KEY`, and the
agent's `request_kwargs` carry it as `extra_headers`, the OpenAI client's per-request headers:
an agent that passes them to `chat.completions.create(**request_kwargs)` is authenticated
whatever `api_key` its client was built with.
"""

from __future__ import annotations

import asyncio
import functools

import httpx

from miles_core.agents.layers import AgentFn, AgentResult, GenerateInput, GenerateOutput
from miles_core.processes.auth import bearer
from miles_core.processes.ssl_context import shared_ssl_context
from miles_core.types import Status, sample_from_json


async def session_generate(
    inp: GenerateInput, agent: AgentFn, timeout_s: float = 300.0
) -> GenerateOutput:
    # no pooled connections: an episode may idle longer than the server keeps one open
    limits = httpx.Limits(max_keepalive_connections=0)
    headers = bearer(inp.api_key)
    request_kwargs = dict(inp.request_kwargs) | ({"extra_headers": headers} if headers else {})
    async with httpx.AsyncClient(
        base_url=inp.session_url,
        timeout=60.0,
        limits=limits,
        headers=headers,
        verify=shared_ssl_context(),  # not one built per episode (processes/ssl_context.py)
    ) as http:
        body = {"rollout_id": inp.rollout_id, "metadata": {"agent": True}}
        if inp.routing_key is not None:
            body["routing_key"] = inp.routing_key
        r = await http.post("/sessions", json=body)
        r.raise_for_status()
        sid = r.json()["session_id"]
        result, error = AgentResult(), None
        try:
            value = await asyncio.wait_for(
                agent(
                    f"{inp.session_url}/sessions/{sid}/v1",
                    list(inp.prompt),
                    request_kwargs,
                    dict(inp.metadata),
                ),
                timeout_s,
            )
            result = AgentResult.of(value)
        except TimeoutError:
            error = f"agent timed out after {timeout_s:g} s"
        except Exception as e:  # noqa: BLE001  (any agent failure is the episode's, not ours)
            error = f"agent failed: {e!r}"
        try:
            data = await http.post(f"/sessions/{sid}/samples", json={"reward": result.reward})
            data.raise_for_status()
            samples = [sample_from_json(s) for s in data.json()["samples"]]
        finally:
            await http.delete(f"/sessions/{sid}")
    if error is not None:
        for s in samples:
            s.status = Status.FAILED
            s.metadata["error"] = error
    return GenerateOutput(samples, result.reward, result.metrics, error)


def make_session_generate(agent: AgentFn, timeout_s: float = 300.0):
    """A generate function (GenerateInput → GenerateOutput) running `agent` in sessions."""
    return functools.partial(session_generate, agent=agent, timeout_s=timeout_s)
