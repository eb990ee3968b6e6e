"""Trainer-side sample production: where a run's rollouts come from per mode (`sources`), the
rollout function, the async producer and its buffer state, group sources and reward scoring."""
