"""SFT demonstrations of any sandbox environment (`environment.py`): its scripted solution run
for real in a sandbox, rendered as the conversation the agent would have (instruction → one
`run` call per command → its output → "done") with the run's TITO family, so the ids are the
ones the session server records in RL; the loss mask covers the assistant's turns only."""

from __future__ import annotations

import json
from collections.abc import Sequence

from miles_core.envs.environment import Environment
from miles_core.envs.sandbox import Sandbox, SandboxLimits
from miles_core.envs.sandbox_agent import observation
from miles_core.tito import TitoFamily

DONE = "done"


def tool_call(i: int, cmd: str) -> dict:
    """The assistant message that calls `run` with `cmd` (call id `call_<i>`)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": cmd})},
            }
        ],
    }


def demonstration(
    task: Environment,
    family: TitoFamily,
    limits: SandboxLimits | None = None,
    detours: Sequence[str] = (),
) -> tuple[list[int], list[int], int]:
    """(token ids, loss mask over the ids after the prompt, prompt length) of `task` solved by
    its script, after the `detours` (commands that change nothing, e.g. `ls`: a demonstration
    that takes more turns than needed). RuntimeError if the script does not solve it."""
    ids = family.prompt([{"role": "user", "content": task.instruction}])
    prompt_len = len(ids)
    mask: list[int] = []
    with Sandbox(limits) as sandbox:
        task.setup(sandbox)
        for i, cmd in enumerate([*detours, *task.solution]):
            done = family.completion(tool_call(i, cmd))
            output = observation(sandbox.run(cmd))
            tool = {"role": "tool", "tool_call_id": f"call_{i}", "content": output}
            added = family.append([tool])
            ids += done + added
            mask += [1] * len(done) + [0] * len(added)
        if task.check(sandbox) != 1.0:
            raise RuntimeError(f"the scripted solution does not solve {task.instruction!r}")
    final = family.completion({"role": "assistant", "content": DONE})
    ids += final
    mask += [1] * len(final)
    return ids, mask, prompt_len


def call_lengths(task: Environment, family: TitoFamily) -> list[int]:
    """The ids of each scripted `run` call as the model would write it (no sandbox needed)."""
    return [len(family.completion(tool_call(i, cmd))) for i, cmd in enumerate(task.solution)]
