"""The tool-using agent function for sandbox environments (`environment.py`): any task that
provides setup / instruction / check / scripted solution.

    async run_agent(base_url, prompt, request_kwargs, metadata) -> {"reward", "metrics"}

`metadata` (built by the rollout from the run's config): "task", the environment as a dict;
"environment", its class's import path (the data task's, never an episode's); "max_turns";
"turn_slack" (optional: the turn limit is then the scripted solution's tool calls plus this
many, at most max_turns); "limits", the sandbox limits (`SandboxLimits` fields). The agent sets
the task up in a fresh sandbox, then, for up to `max_turns` turns, asks the model (OpenAI chat
at `base_url`) for the next step: every `run` tool call is executed in the sandbox and its output
returned as the tool result. A reply without tool calls ends the episode, and so do a reply cut
off at max_tokens (`truncated`) and a conversation that has no room left (`context_full`: the
model's context or the session's token budget). `bad_calls` counts replies holding a tool call
that the run's TITO family could not parse (the session server says so with each reply,
`miles.broken_tool_call`, from `TitoFamily.broken_tool_call`) and calls the agent cannot run.
The checker's score of the final workspace is the reward. Where the
episode's time went: `model_s` waiting for the model's replies (the session server, the router
and the engine's queue included), `sandbox_s` in the sandbox (setup, commands, check, waiting
for a worker thread included); the rollout adds the whole episode's `episode_s`. Tools
are not sent with the request (a long tool schema does not fit a tiny model's context); the
model learns the call format from demonstrations.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from miles_core.envs.environment import load_environment
from miles_core.envs.sandbox import RunResult, Sandbox, SandboxLimits

OBSERVATION_CHARS = 200
CONTEXT_FULL = "context_length_exceeded"  # the OpenAI error code the session server answers


def observation(result: RunResult) -> str:
    text = result.output[:OBSERVATION_CHARS]
    if result.killed_by:
        return f"{text}[killed: {result.killed_by}]"
    if result.exit_code:
        return f"{text}[exit {result.exit_code}]"
    return text or "[ok]"


def command_of(call) -> str | None:
    """The shell command of a `run` tool call, or None if the call is not one."""
    if call.function.name != "run":
        return None
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return None
    cmd = args.get("cmd") if isinstance(args, dict) else None
    return cmd if isinstance(cmd, str) and cmd.strip() else None


def _context_full(error) -> bool:
    return getattr(error, "code", None) == CONTEXT_FULL or "context length" in str(error)


async def run_agent(
    base_url: str, prompt: list[dict], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict:
    from openai import AsyncOpenAI, BadRequestError, DefaultAsyncHttpxClient

    from miles_core.processes.ssl_context import shared_ssl_context

    if "environment" not in metadata:
        raise ValueError("metadata has no 'environment' (the environment class's import path)")
    task = load_environment(metadata["environment"]).from_dict(metadata["task"])
    max_turns = int(metadata.get("max_turns", 4))
    if metadata.get("turn_slack") is not None:
        max_turns = min(max_turns, len(task.solution) + int(metadata["turn_slack"]))
    limits = SandboxLimits(**metadata.get("limits", {}))
    client = AsyncOpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        # OpenAI's client defaults, with the process's TLS context (not one built per episode)
        http_client=DefaultAsyncHttpxClient(verify=shared_ssl_context()),
    )
    messages = list(prompt)
    turns = commands = bad_calls = truncated = context_full = 0
    clock = {"model_s": 0.0, "sandbox_s": 0.0}

    async def timed(key: str, call):
        t = time.perf_counter()
        try:
            return await call
        finally:
            clock[key] += time.perf_counter() - t

    try:
        with Sandbox(limits) as sandbox:
            await timed("sandbox_s", asyncio.to_thread(task.setup, sandbox))
            for _ in range(max_turns):
                try:
                    r = await timed(
                        "model_s",
                        client.chat.completions.create(
                            model="policy", messages=messages, **request_kwargs
                        ),
                    )
                except BadRequestError as e:
                    if not _context_full(e):
                        raise
                    context_full = 1  # no room for another turn: grade what was done
                    break
                turns += 1
                choice = r.choices[0]
                calls = choice.message.tool_calls or []
                reply: dict[str, Any] = {
                    "role": "assistant",
                    "content": choice.message.content or "",
                }
                if calls:
                    reply["tool_calls"] = [
                        c.model_dump(include={"id", "type", "function"}) for c in calls
                    ]
                messages.append(reply)
                if choice.finish_reason == "length":
                    truncated += 1  # cut off at max_tokens: whatever it was, it ends here
                    break
                # the session server's family saw tool-call markup it could not parse
                bad_calls += bool((r.model_extra or {}).get("miles", {}).get("broken_tool_call"))
                if not calls:
                    break
                for call in calls:
                    cmd = command_of(call)
                    if cmd is None:
                        bad_calls += 1
                        text = '[error: call run with a JSON object {"cmd": "..."}]'
                    else:
                        commands += 1
                        ran = await timed("sandbox_s", asyncio.to_thread(sandbox.run, cmd))
                        text = observation(ran)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
            reward = await timed("sandbox_s", asyncio.to_thread(task.check, sandbox))
    finally:
        await client.close()
    metrics = {
        "turns": float(turns),
        "commands": float(commands),
        "bad_calls": float(bad_calls),
        "truncated": float(truncated),
        "context_full": float(context_full),
        **clock,
    }
    return {"reward": reward, "metrics": metrics}
