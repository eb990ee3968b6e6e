"""What megatron-core 0.16.1 needs to train on CPU with gloo (it is written for CUDA). Applied
once per process, only where torch has no CUDA, before a model is built:

1. its CUDA RNG tracker calls `torch.cuda.get_rng_state()`: the inference tracker instead (its
   `fork()` is a no-op; every rank seeds torch's CPU generator);
2. a few code paths move buffers `.to(torch.cuda.current_device())` (RoPE's `inv_freq`): that
   answers the CPU device here (torch has no CUDA to ask, so nothing else can mean it);
3. `moe_utils` refers to TransformerEngine names that only exist when TE imports: defined as
   None, so the non-TE paths run;
4. a pipeline's last stage moves its copy of tied embeddings `.cuda()` before reducing it with
   the first stage's: `Tensor.cuda` returns the tensor itself (without CUDA it could only fail);
5. the checkpoint writer synchronises CUDA before copying tensors out: `torch.cuda.synchronize`
   does nothing (there is no device to wait for).

Not needed on CUDA, where Megatron runs as it is (nccl, its own optimizer). What stays GPU-only:
TransformerEngine layers, packed (THD) sequences, context parallelism, the alltoall dispatcher.
"""

from __future__ import annotations

import torch

_TE_NAMES = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)
_applied = False


def apply_cpu_shim() -> None:
    """Idempotent; a no-op where CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in _TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    _applied = True
