"""The built-in trainer backends, one module (or package) per backend registering itself under
its name (`train/backend.py: BACKENDS`): `fsdp` (FSDP2) and `megatron` (Megatron-core)."""
