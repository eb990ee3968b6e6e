"""The built-in TITO families, one module per chat template registering itself under the
module's name (`tito/registry.py: FAMILIES`): `tiny` (our ChatML), `qwen3`, `mistral`."""
