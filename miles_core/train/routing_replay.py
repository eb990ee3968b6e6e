"""Routing replay (R3): the trainer's routers take the experts the engine routed each token to at
rollout (`models/moe.py: ROUTES`, a per-token field), and a checker counts how often the trainer's own
choice differs. Stages need no cursor: the same routes serve every forward of a micro-batch
(the old-log-prob pass, the training pass and any recomputation of it).

`RouteReplay` is the backend-neutral part: inside `with replay.micro_batch(mb)`, a backend's
router hook hands `choose(layer, natural)` its own top-k for the flattened positions of the
micro-batch and gets back the experts to run:
- with `replay`, the recorded experts for every position the engine recorded (padding and each
  row's last position, which no engine call processed, keep their own choice);
- with `check`, the (position, layer) pairs whose expert sets differ are counted
  (`take_counts`, the step's `routing_mismatch_fraction`).
Outside `micro_batch` (and for a reference model, never hooked) routers route by themselves.

`RouterReplay` hooks the HF MoE modules (the FSDP2 backend): the `mlp.gate` of each layer with
experts, in layer order; a replayed router still returns the weights its family's rule gives the
chosen experts from its live scores (its model family's `route_weights`), so it still gets
gradients. Megatron's
routers: `miles_core.train.backends.megatron.routing_replay`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch

from miles_core.models import moe
from miles_core.models.family import family_of
from miles_core.models.moe import ROUTES, is_moe_layer
from miles_core.train.forward import MicroBatch

# how a family turns its router's logits into the weights of given experts
WeightRule = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class RouteReplay:
    """The recorded routes of the micro-batch in flight, and the checker's counts."""

    def __init__(self, layers: int, replay: bool, check: bool, seq_first: bool = False):
        if not layers:
            raise ValueError("routing replay: the model has no mixture-of-experts layers")
        self.layers, self.replay, self.check = layers, replay, check
        self.seq_first = seq_first  # positions flattened [T, B] (Megatron) rather than [B, T]
        self._routes: torch.Tensor | None = None  # [N, MoE layers, k] for this forward's rows
        self._recorded: torch.Tensor | None = None  # [N] bool: rows the engine recorded
        self.mismatched = 0  # (position, MoE layer) pairs routed apart, since the last take
        self.checked = 0
        self.totals = [0, 0]  # the same, never reset: (routed apart, checked)

    def choose(self, layer: int, natural: torch.Tensor) -> torch.Tensor:
        """The experts MoE layer `layer` (its index among the model's MoE layers) runs for the
        positions whose own top-k is `natural` [N, k]: `natural` itself outside `micro_batch`
        or without replay."""
        if self._routes is None:
            return natural
        recorded = self._routes[:, layer].to(natural.device, natural.dtype)
        ok = self._recorded.to(natural.device)
        if recorded.shape != natural.shape:
            raise ValueError(
                f"routing replay: {tuple(recorded.shape)} recorded routes for a router that "
                f"routes {tuple(natural.shape)} (positions × top-k)"
            )
        if self.check:
            differ = (natural.sort(-1).values != recorded.sort(-1).values).any(-1)
            apart, checked = int((differ & ok).sum()), int(ok.sum())
            self.mismatched += apart
            self.checked += checked
            self.totals[0] += apart
            self.totals[1] += checked
        if not self.replay:
            return natural
        return torch.where(ok[:, None], recorded, natural)

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch) -> Iterator[None]:
        """The routers replay (and check against) `mb`'s recorded routes in this block."""
        fields = mb.padded.fields
        if ROUTES.name not in fields:
            raise ValueError(
                f"routing replay: the micro-batch carries no {ROUTES.name} (the engine did not "
                f"return them: rollout.token_fields needs {moe.PATH})"
            )
        routes = fields[ROUTES.name]  # [B, T, L, k], sequence-aligned: row j = input position j
        b, t = mb.padded.input_ids.shape
        if routes.shape[:2] != (b, t) or routes.shape[2] != self.layers:
            raise ValueError(
                f"routing replay: routes of shape {tuple(routes.shape)} for a batch of "
                f"{b} × {t} positions and {self.layers} MoE layers"
            )
        lengths = torch.tensor([len(x) for x in mb.batch.tokens])
        recorded = torch.arange(t)[None, :] < (lengths - 1)[:, None]  # the last row: none
        if self.seq_first:
            routes, recorded = routes.transpose(0, 1), recorded.t()
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


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of an HF model, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if is_moe_layer(layer.mlp)]


class RouterReplay(RouteReplay):
    """Routing replay on the HF MoE modules of `model` (their routers' forwards wrapped)."""

    def __init__(self, model: torch.nn.Module, replay: bool, check: bool):
        self.routers = routers_of(model)
        super().__init__(len(self.routers), replay, check)
        model_type = getattr(model.config, "model_type", None)
        family = family_of(model_type)
        rule: WeightRule | None = family.route_weights if family else None
        if replay and self.routers and rule is None:
            raise ValueError(
                f"routing replay: the model family {model_type!r} has no route_weights "
                "(how its routers weigh the experts they chose: miles_core/models/README.md)"
            )
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(self._wrap(layer, router.forward, rule), router)

    def _wrap(self, layer: int, natural_forward, rule: WeightRule | None):
        def forward(router, hidden):
            logits, weights, natural = natural_forward(hidden)
            idx = self.choose(layer, natural)
            if idx is natural:
                return logits, weights, natural
            return logits, rule(router, logits, idx), idx

        return forward
