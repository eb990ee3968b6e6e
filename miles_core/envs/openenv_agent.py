"""The OpenEnv adapter: an environment served by `openenv-core` (reset/step over its WebSocket
protocol, any language or container behind it) as an agent function.

    async run_agent(base_url, prompt, request_kwargs, metadata) -> {"reward", "metrics"}

`metadata["task"]` (the example's label) says where and how:

- `env_url`: the environment server (or the `MILES_OPENENV_URL` environment variable);
- `reset`: keyword arguments for the environment's `reset` (e.g. the task instance, a seed);
- `action_field` (default "message"): the action is {action_field: the model's reply text};
- `observation_field`: the observation's text (default: its only field when it has one text
  field, else the whole observation as JSON).

The loop: reset → the observation becomes a user message (unless it repeats the prompt's last
message) → the model replies through the session at `base_url` → the reply is the action →
step; until the environment says done or `max_turns` replies. The reward is the sum of the
step rewards, set by the environment. `openenv-core` is an optional dependency (`.[openenv]`);
without it, a run naming this agent function is refused before anything starts.
"""

from __future__ import annotations

import json
import os
from typing import Any

from openai import AsyncOpenAI

# imported here, not in run_agent: without the extra, naming this agent fails in preflight
from openenv.core import GenericEnvClient

ENV_URL_VAR = "MILES_OPENENV_URL"


def observation_text(observation: Any, field: str | None) -> str:
    if field is not None:
        if not isinstance(observation, dict) or field not in observation:
            raise ValueError(f"the observation has no field {field!r}: {observation!r:.200}")
        return str(observation[field])
    if isinstance(observation, str):
        return observation
    if isinstance(observation, dict) and len(observation) == 1:
        (value,) = observation.values()
        if isinstance(value, str):
            return value
    return json.dumps(observation)


async def run_agent(
    base_url: str, prompt: list[dict], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict:
    task = metadata.get("task") or {}
    env_url = task.get("env_url") or os.environ.get(ENV_URL_VAR)
    if not env_url:
        raise ValueError(f"no OpenEnv server: set the task's 'env_url' or ${ENV_URL_VAR}")
    action_field = task.get("action_field", "message")
    obs_field = task.get("observation_field")
    max_turns = int(metadata.get("max_turns", 4))
    messages = list(prompt)
    reward, turns, steps, done = 0.0, 0, 0, False
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    try:
        async with GenericEnvClient(base_url=env_url) as env:
            result = await env.reset(**task.get("reset", {}))
            text = observation_text(result.observation, obs_field)
            if not messages or messages[-1].get("content") != text:
                messages.append({"role": "user", "content": text})
            while turns < max_turns and not result.done:
                r = await client.chat.completions.create(
                    model="policy", messages=messages, **request_kwargs
                )
                turns += 1
                reply = r.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": reply})
                result = await env.step({action_field: reply})
                steps += 1
                reward += float(result.reward or 0.0)
                done = bool(result.done)
                if not done and turns < max_turns:
                    text = observation_text(result.observation, obs_field)
                    messages.append({"role": "user", "content": text})
    finally:
        await client.close()
    metrics = {"turns": float(turns), "env_steps": float(steps), "env_done": float(done)}
    return {"reward": reward, "metrics": metrics}
