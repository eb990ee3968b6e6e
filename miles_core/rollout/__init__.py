"""Rollout: the engine protocol, the embedded engine, the SGLang-shaped request/response, the rollout function."""
