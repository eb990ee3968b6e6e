"""Black-box agents: any program that takes an OpenAI base URL. `command_agent(argv)` is an
agent function that runs the program with OPENAI_BASE_URL set to the session's URL,
OPENAI_API_KEY to the session server's key ("none" without one) and the task as JSON in MILES_TASK ({"prompt", "metadata"}); if its last stdout line is a JSON object with
"reward" (and optional "metrics"-like numbers), that is the environment's reward. The program is
killed if the episode is cancelled (timeout); a non-zero exit fails the episode.

In a run's config: `agent.function: miles_core.agents.blackbox:run_command` with
`agent.command: [python, path/to/agent.py]` (`python` means this interpreter)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any


def command_agent(argv: list[str], env: dict[str, str] | None = None):
    async def run_agent(
        base_url: str, prompt: list[dict], request_kwargs: dict, metadata: dict
    ) -> dict | None:
        task = {"prompt": prompt[-1]["content"] if prompt else "", "metadata": metadata}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            start_new_session=True,  # its own process group: sub-agents it spawns die with it
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={
                **os.environ,
                **(env or {}),
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": _session_key(request_kwargs) or "none",
                "MILES_TASK": json.dumps(task),
            },
        )
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"{argv[-1]} exited with code {proc.returncode}: {tail[0]}")
        return _result(out.decode(errors="replace"))

    return run_agent


def _session_key(request_kwargs: dict) -> str | None:
    """The session server's key, from the headers session_generate hands the agent."""
    auth = (request_kwargs.get("extra_headers") or {}).get("Authorization", "")
    return auth.removeprefix("Bearer ") or None


def _result(stdout: str) -> dict[str, Any] | None:
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    metrics = {k: float(v) for k, v in data.items() if k != "reward" and isinstance(v, int | float)}
    return {"reward": data.get("reward"), "metrics": metrics}


async def run_command(
    base_url: str, prompt: list[dict], request_kwargs: dict, metadata: dict
) -> dict | None:
    """The agent function for config-driven runs: the program is `metadata["command"]` (the
    rollout passes `agent.command`); a relative script path resolves from the working dir."""
    argv = metadata.get("command")
    if not argv or not isinstance(argv, list):
        raise ValueError("run_command needs agent.command: the agent program's argv")
    argv = [sys.executable if a in ("python", "python3") else a for a in argv]
    return await command_agent(argv)(base_url, prompt, request_kwargs, metadata)


def python_agent(script: str, env: dict[str, str] | None = None):
    """`command_agent` for a Python script run with this interpreter."""
    return command_agent([sys.executable, script], env)
