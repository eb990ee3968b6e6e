"""The terminal suite (`terminal.py`) as data tasks: `terminal` draws every training kind (and,
for evaluation, the held-out compositions too); `terminal_basics` draws the single tasks only,
what the SFT demonstrations cover; `terminal_detours` the same, with demonstrations that look
around first (`ls`, then `pwd`: none, one or both before the script), a habit RL can unlearn
under `agent.turn_slack`."""

from __future__ import annotations

from miles_core.data.tasks import TASKS
from miles_core.envs.sandbox_tasks import SandboxTasks
from miles_core.envs.terminal import (
    HELD_OUT_KINDS,
    SINGLE_KINDS,
    TRAIN_KINDS,
    TerminalTask,
    make_task,
)

TERMINAL = TASKS.register(
    "terminal", SandboxTasks("terminal", TerminalTask, make_task, TRAIN_KINDS, HELD_OUT_KINDS)
)
TERMINAL_BASICS = TASKS.register(
    "terminal_basics", SandboxTasks("terminal_basics", TerminalTask, make_task, SINGLE_KINDS)
)
TERMINAL_DETOURS = TASKS.register(
    "terminal_detours",
    SandboxTasks("terminal_detours", TerminalTask, make_task, SINGLE_KINDS, detours=("ls", "pwd")),
)
