"""The built-in advantage estimators, one module per estimator registering itself under the
module's name (`train/advantage.py: ADVANTAGES`): `grpo` and `rloo`."""
