"""Routing replay (R3) on the HF MoE modules: the trainer's routers take the experts the engine
routed each token to at rollout (`routed_experts`, a per-token field), and a checker counts how
often the trainer's own choice differs.

`RouterReplay(model, replay, check)` wraps the forward of every MoE router of `model` (the
`mlp.gate` of each layer with `experts`, in layer order). Inside `with replay.micro_batch(mb)`
each router:
- computes its logits and its own top-k as always (`natural`);
- with `replay`, returns the recorded experts instead, for every position the engine recorded
  (padding and each row's last position, which no engine call processed, keep their own
  choice), with the weights the family's rule gives those experts from the live scores
  (`replay_weights`): the router still gets gradients, through the weights;
- with `check`, counts the (position, layer) pairs whose expert set differs between the two.
The same routes serve every forward of the micro-batch (the old-log-prob pass, the training
pass and any recomputation of it), so stages need no cursor. Outside `micro_batch` (and for the
reference model, which is not wrapped) routers route by themselves.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch

from miles_core.engine.moe import is_moe_layer
from miles_core.routed_experts import FIELD_NAME
from miles_core.train.forward import MicroBatch

# how a family turns its router's logits into the weights of given experts; by router class
WeightRule = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_rule(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE (Qwen2-MoE, Mixtral): softmax over experts, the top-k renormalised if asked."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if getattr(router, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _sigmoid_rule(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """GLM4-MoE / DeepSeek-V3: sigmoid scores (the correction bias only chooses, never
    weighs), renormalised if asked, times the routed scaling factor."""
    w = logits.float().sigmoid().gather(1, idx)
    if getattr(router, "norm_topk_prob", False):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


WEIGHT_RULES: dict[str, WeightRule] = {
    "Qwen3MoeTopKRouter": _softmax_rule,
    "Glm4MoeTopkRouter": _sigmoid_rule,
}


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of `model`, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if is_moe_layer(layer.mlp)]


class RouterReplay:
    def __init__(self, model: torch.nn.Module, replay: bool, check: bool):
        self.replay, self.check = replay, check
        self.routers = routers_of(model)
        if not self.routers:
            raise ValueError("routing replay: the model has no mixture-of-experts layers")
        for router in self.routers:
            name = type(router).__name__
            if replay and name not in WEIGHT_RULES:
                raise ValueError(
                    f"routing replay: no weight rule for the router {name} "
                    f"(known: {', '.join(sorted(WEIGHT_RULES))})"
                )
        self._routes: torch.Tensor | None = None  # [N, MoE layers, k] for this forward's rows
        self._recorded: torch.Tensor | None = None  # [N] bool: rows the engine recorded
        self.mismatched = 0  # (position, MoE layer) pairs routed apart, since the last take
        self.checked = 0
        self.totals = [0, 0]  # the same, never reset: (routed apart, checked)
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(self._wrap(layer, router.forward), router)

    def _wrap(self, layer: int, natural_forward):
        rule = WEIGHT_RULES.get(type(self.routers[layer]).__name__)

        def forward(router, hidden):
            logits, weights, natural = natural_forward(hidden)
            if self._routes is None:
                return logits, weights, natural
            recorded = self._routes[:, layer].to(natural.device, natural.dtype)
            ok = self._recorded.to(natural.device)
            if self.check:
                differ = (natural.sort(-1).values != recorded.sort(-1).values).any(-1)
                apart, checked = int((differ & ok).sum()), int(ok.sum())
                self.mismatched += apart
                self.checked += checked
                self.totals[0] += apart
                self.totals[1] += checked
            if not self.replay:
                return logits, weights, natural
            idx = torch.where(ok[:, None], recorded, natural)
            return logits, rule(router, logits, idx), idx

        return forward

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch) -> Iterator[None]:
        """The routers replay (and check against) `mb`'s recorded routes in this block."""
        fields = mb.padded.fields
        if FIELD_NAME not in fields:
            raise ValueError(
                "routing replay: the micro-batch carries no routed_experts (the engine did not "
                "return them: rollout.return_routed_experts)"
            )
        routes = fields[FIELD_NAME]  # [B, T, L, k], sequence-aligned: row j = input position j
        b, t = mb.padded.input_ids.shape
        if routes.shape[:2] != (b, t) or routes.shape[2] != len(self.routers):
            raise ValueError(
                f"routing replay: routes of shape {tuple(routes.shape)} for a batch of "
                f"{b} × {t} positions and {len(self.routers)} MoE layers"
            )
        lengths = torch.tensor([len(x) for x in mb.batch.tokens])
        recorded = torch.arange(t)[None, :] < (lengths - 1)[:, None]  # the last row: none
        self._routes = routes.reshape(b * t, *routes.shape[2:]).long()
        self._recorded = recorded.reshape(-1)
        try:
            yield
        finally:
            self._routes = self._recorded = None

    def take_counts(self) -> dict[str, float]:
        """The checker's counts since the last call, as ratio stats (`__num` / `__den`)."""
        out = {
            "routing_mismatch_fraction__num": float(self.mismatched),
            "routing_mismatch_fraction__den": float(self.checked),
        }
        self.mismatched = self.checked = 0
        return out if self.check else {}
