"""The built-in rollout modes, one module per mode registering itself under the module's name
(`rollout/mode.py: MODES`): `sync`, `one_step_off`, `fully_async`."""
