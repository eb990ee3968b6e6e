"""`data.task: terminal`: terminal-use episodes as a Task. Each Example's prompt is the task's
instruction and its label the task itself (files, checker data, scripted solution); the reward
is set by the environment after the episode (the agent function), not by `score`.

`demonstration` turns an example into a multi-turn SFT sample: the scripted solution is run in a
sandbox for its real output, the conversation (instruction → `run` call → output → "done") is
tokenized with a TITO family, and the loss mask covers only the assistant's turns.
"""

from __future__ import annotations

import json
import random

from miles_core.data.tasks import Example, Score
from miles_core.envs.sandbox import Sandbox
from miles_core.envs.terminal import KINDS, TerminalTask, make_task
from miles_core.envs.terminal_agent import observation
from miles_core.tito import get_family

DONE = "done"


class TerminalTasks:
    name = "terminal"
    needs_label = True
    agentic = True  # rewards come from the environment, through the agent function

    def __init__(self, family: str = "tiny", kinds: tuple[str, ...] = KINDS):
        self.family = family
        self.kinds = kinds

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            task = make_task(self.kinds[i % len(self.kinds)], rng)
            out.append(Example(prompt=task.instruction, label=task.to_dict()))
        return out

    def score(self, completion: str, label) -> Score:
        raise ValueError("terminal tasks are scored by their environment (agent.function)")

    def demonstration(self, example: Example) -> tuple[list[int], list[int]]:
        """(token ids, loss mask over the ids after the prompt) of the scripted episode."""
        task = TerminalTask.from_dict(example.label)
        family = get_family(self.family)
        messages: list[dict] = [{"role": "user", "content": task.instruction}]
        ids = family.prompt(messages)
        prompt_len = len(ids)
        mask: list[int] = []
        with Sandbox() as sandbox:
            task.setup(sandbox)
            for i, cmd in enumerate(task.solution):
                call = {
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
                done = family.completion(call)
                tool = {
                    "role": "tool",
                    "tool_call_id": f"call_{i}",
                    "content": observation(sandbox.run(cmd)),
                }
                added = family.append([tool])
                ids += done + added
                mask += [1] * len(done) + [0] * len(added)
                messages += [call, tool]
            if task.check(sandbox) != 1.0:
                raise RuntimeError(f"the scripted solution does not solve {task.instruction!r}")
        final = family.completion({"role": "assistant", "content": DONE})
        ids += final
        mask += [1] * len(final)
        assert len(ids) - prompt_len == len(mask)
        return ids, mask
