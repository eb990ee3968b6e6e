"""LoRA adapters (`train.lora`, docs/lora.md): trained with peft on a frozen base, pushed alone,
served unmerged per request.

`names.py` (how adapter tensors are named: peft checkpoint keys, and the wire names pushes carry),
`targets.py` (which linear modules an adapter covers), `delta.py` (the adapter's term of a linear
layer, for one adapter or per batch row), `adapter.py` (an adapter's tensors and config, read
and written as a peft directory), `served.py` (what an engine holds: loaded adapters and which
rows use which), `trainer.py` (the trainer's side: peft layers injected into the model)."""
