"""Reward shaping for the sandbox agent (`sandbox_agent.py`), as an `agent.reward_function` hook
(`miles_core/agents/rewards.py`): on top of the environment's raw grade, which is still what
`*/success_rate` reports.

`well_formed`: the grade counts only for an episode whose every reply was well formed — no call
the agent could not run or parse (`bad_calls`), no reply cut off at `agent.max_tokens`
(`truncated`) — else 0. Without it, a solved episode is rewarded whole, whatever the model wrote
after the solving command: the turns after a solution are free, and RL learns that broken
replies after a tool result cost nothing (measured on the terminal suite: tool calls degenerate
into repeated characters within 20 steps; docs/agents-and-sessions.md).
"""

from __future__ import annotations

from miles_core.agents.rewards import Episode

UNCLEAN = ("bad_calls", "truncated")


def well_formed(episode: Episode) -> float:
    grade = float(episode.env_reward if episode.env_reward is not None else episode.reward or 0)
    return 0.0 if any(episode.metrics.get(k, 0) for k in UNCLEAN) else grade
