"""What `train.true_on_policy` requires of a run, stated once and checked before it starts.

The mode holds when every number between a token's decode and the trainer's recompute of it
comes from the invariant forward (`ops.py`, the model family's `invariant`): the model family
must have one for the model's config, the engine and the trainer backend must run it, and no
setting may route a forward around it. Each plug-in says for itself whether it can (an engine
kind's `true_on_policy_refuses(options)`, a backend's `true_on_policy_refuses(train settings)`),
so a new one joins without an edit here. Later capabilities (quantised rollouts, LoRA) add
their conditions to `settings_refused` instead of bypassing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class TrueOnPolicyContract:
    # one forward for the engines and the trainer: weights, activations and the KV cache in the
    # compute dtype (`dtype`), log-softmax of the logits in float32
    name: str = "invariant-v1"

    def dtype(self, config: Any) -> str:
        """The compute dtype of the run's invariant forward: its engines' (a `RunConfig`'s
        `rollout.engine_options`), which the trainer's forward takes."""
        from miles_core.engines.registry import ENGINES

        r = config.rollout
        return ENGINES.get(r.engine).compute_dtype(r.engine_options)

    def settings_refused(self, config: Any) -> list[str]:
        """What of the run's settings (a `RunConfig`) breaks the contract, each naming its
        setting; [] when they meet it."""
        from miles_core.engines.registry import ENGINES
        from miles_core.rollout.mode import MODES
        from miles_core.train.backend import BACKENDS

        r, t = config.rollout, config.train
        bad = []
        reason = ENGINES.get(r.engine).true_on_policy_refuses(r.engine_options)
        if reason:
            bad.append(f"rollout.engine {r.engine}: {reason}")
        refuses = getattr(BACKENDS.get(t.backend), "true_on_policy_refuses", None)
        reason = refuses(t.model_dump()) if refuses else "it has no invariant forward"
        if reason:
            bad.append(f"train.backend {t.backend}: {reason}")
        if t.share_prompts:
            bad.append(
                "train.share_prompts: the shared-prompt forward attends over a prompt's keys "
                "computed apart from its rows; set it false (the mode's default)"
            )
        if MODES.get(r.mode).ahead and r.pause_mode == "in_place":
            bad.append(
                f"rollout.pause_mode in_place (rollout.mode {r.mode}): a request frozen across "
                "a push decodes on with keys and values of the old weights, a mix no single "
                "policy's forward computes; use retract or abort"
            )
        if t.device == "cuda":
            bad.append("train.device cuda: the invariant kernels are checked on CPU only")
        return bad

    def token_fields(self) -> list[str]:
        """The per-token fields the mode adds to `rollout.token_fields`: the weight version of
        every response token, so a stale token is recomputed under the weights that made it."""
        from miles_core.true_on_policy import token_versions

        return [token_versions.PATH]

    def model_refused(self, hf_config: dict[str, Any]) -> str | None:
        """Why the model (its HF config, a dict) has no invariant forward, or None."""
        from miles_core.models.family import family_of

        model_type = hf_config.get("model_type")
        family = family_of(model_type)
        if family is None:
            return f"model_type {model_type!r} has no model family (models/<family>/)"
        return family.invariant_refuses(SimpleNamespace(**hf_config))


TRUE_ON_POLICY = TrueOnPolicyContract()


def trainer_dtype(settings: dict[str, Any]):
    """The torch dtype a trainer's invariant forward computes in, from its settings (what
    `run/training.py: build_trainer` hands it as `true_on_policy_dtype`)."""
    import torch

    return getattr(torch, settings.get("true_on_policy_dtype") or "float32")
