"""The built-in losses, one module per loss registering itself under the module's name
(`train/loss.py: LOSSES`): `policy` (PPO-clip / GRPO) and `sft`. The per-token pieces they share
are `train/loss_terms.py`."""
