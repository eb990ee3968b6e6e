"""Several engine servers behind SGLang's router (`rollout.engine_options.num_engines` > 1): one
`RolloutEngine` whose generation goes through the router and whose control calls go to every
engine.

A request's routing key sticks to one engine (`router.py`: the `manual` policy): the session
server sends each session's id, so an agent's turns reach the engine that holds its prefix. The
router health-checks its engines and stops routing to one that fails; the supervisor of a dead
engine replaces it, out of the router's rotation until it serves the current weights
(`fleet.py`). A generation call that dies with its engine waits for the replacement and goes
through the router once more (`supervisor.RoutedSupervision`); a call the session server makes
fails its episode (FAILED, masked, counted).

Control calls fan out: pause / resume / the weight version to every engine; the weights checksum
is every engine's and must agree; load counters are summed. Weight pushes go to the engines
themselves (`EngineFleet.engines`), not through the router.
"""

from __future__ import annotations

from miles_core.engines.http import HttpEngine


class EnginesDisagree(RuntimeError):
    """Two engines hold different weights."""


class RoutedEngine(HttpEngine):
    def __init__(self, router_url: str, members: list[HttpEngine], **kwargs):
        # the router takes single requests (HttpEngine batches only for our own servers)
        super().__init__(router_url, batch_size=1, **kwargs)
        self.members = list(members)
        self.weight_routes = frozenset.intersection(*(m.weight_routes for m in self.members))

    def server_info(self, timeout: float | None = None) -> dict:
        return self.members[0].server_info(timeout)

    @property
    def weight_version(self) -> int:
        """The oldest version an engine serves."""
        return min(m.weight_version for m in self.members)

    def set_weight_version(self, version: int) -> None:
        for m in self.members:
            m.set_weight_version(version)

    def pause(self, mode: str = "abort") -> None:
        for m in self.members:
            m.pause(mode)

    def resume(self) -> None:
        for m in self.members:
            m.resume()

    def abort(self, rid: str | None = None) -> None:
        for m in self.members:
            m.abort(rid)

    def load_counters(self) -> dict[str, float]:
        per_engine = [m.load_counters() for m in self.members]
        if not all(per_engine):
            return {}
        return {k: sum(c[k] for c in per_engine) for k in per_engine[0]}

    def weights_checksum(self, scope: str = "all") -> str:
        sums = {m.url: m.weights_checksum(scope) for m in self.members}
        if len(set(sums.values())) > 1:
            raise EnginesDisagree(f"the engines hold different weights: {sums}")
        return next(iter(sums.values()))

    def close(self) -> None:
        try:
            super().close()
        finally:
            for m in self.members:
                m.close()
