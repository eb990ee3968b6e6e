"""The Megatron-core trainer backend (`train.backend: megatron`): the same HF models trained as a
Megatron `GPTModel` with tensor, pipeline and data parallelism (`train.parallel`).

- `layout.py`: the parallel layout and its checks against the world size and the model's shapes
  (pure Python: config validation imports it);
- `convert.py`: HF ↔ Megatron weights, both directions, and the tensor-parallel split of each;
- `model.py`: the `TransformerConfig` and `GPTModel` of an HF config, for this rank's stage;
- `cpu.py`: what megatron-core needs to run on CPU with gloo;
- `backend.py`: `MegatronBackend`, the `TrainerBackend` (step, log-probs, weights, checkpoints);
- `checkpoint.py`: reshardable distributed checkpoints (model and optimizer).
"""

from miles_core.train.backend import BACKENDS

# registered here, imported when first used: megatron-core loads only for a run that uses it
BACKENDS.register("megatron", "miles_core.train.backends.megatron.backend:MegatronBackend")
