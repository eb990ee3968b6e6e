"""Our CPU rollout engine and its HTTP server: the stand-in for SGLang.

The client side (producer, HttpEngine, supervisor, router) lives in `miles_core/rollout/` and
reaches this package only through the SGLang HTTP API or the `engine_api.RolloutEngine`
protocol; nothing in `rollout/` imports from here.
"""
