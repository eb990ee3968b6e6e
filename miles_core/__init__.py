"""miles_core: the runtime library of the RL post-training system (never imports prefect)."""

from miles_core.env import apply_defaults

apply_defaults()
