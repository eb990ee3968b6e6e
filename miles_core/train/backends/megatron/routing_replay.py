"""Routing replay (R3) on Megatron's routers, through Megatron's own hook: a model built with
`moe_enable_routing_replay` gives each `TopKRouter` a `RouterReplay` instance, and the router
asks it for its top-k (`get_replay_topk(scores, topk, …, default_compute_topk)`) with the
scores it chooses by (softmax logits; GLM's sigmoid scores plus the correction bias). Each of
the policy's instances here computes the natural top-k, hands it to `RouteReplay.choose` (the
recorded experts where the engine recorded the position, the checker's counts), and returns
the chosen experts with their gathered scores, as Megatron's own replay does: the router then
weighs them by its family's rule (softmax over the chosen logits; sigmoid renormalised, times
the scaling factor), so it still gets gradients.

Megatron's token order in an MoE layer is sequence-first ([T, B] flattened), and a pipeline
stage holds some of the layers: each router finds its row of the record from its global layer
number. With expert parallelism each rank routes its own tokens before dispatching them, so the
routes stay rank-local. Megatron keeps a process-wide list of instances (`model.py` clears it
before a build); this class uses the model's own.
"""

from __future__ import annotations

import types

import torch

from miles_core.train.backends.megatron.convert import Shapes
from miles_core.train.routing_replay import RouteReplay


def replay_hooks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model` (this stage's) that carry Megatron's replay hook."""
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


class MegatronRouterReplay(RouteReplay):
    def __init__(self, model: torch.nn.Module, shapes: Shapes, replay: bool, check: bool):
        super().__init__(len(shapes.moe_layers), replay, check, seq_first=True)
        self.routers = replay_hooks(model)
        for router in self.routers:
            layer = shapes.moe_index(router.layer_number - 1)  # Megatron counts from 1
            hook = router.router_replay
            hook.get_replay_topk = types.MethodType(self._topk(layer), hook)

    def _topk(self, layer: int):
        def get_replay_topk(
            hook, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
        ):
            values, natural = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            chosen = self.choose(layer, natural)
            if chosen is natural:
                return values, natural
            return scores.gather(1, chosen), chosen

        return get_replay_topk
