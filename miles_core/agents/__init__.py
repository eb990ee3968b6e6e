"""Agentic rollout: the plug-in layers (layers.py), the session-backed generate function
(session_generate.py), and built-in agents (e.g. miles_core/envs/sandbox_agent.py)."""
