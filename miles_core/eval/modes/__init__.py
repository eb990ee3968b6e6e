"""The built-in evaluation modes, one module per mode registering itself under the module's name
(`eval/mode.py: EVAL_MODES`): `none`, `shared`, `dedicated`, `external`."""
