"""The image engine server as a subprocess, and its client.

`ImageEngineProcess` starts `miles_core.diffusion.server` on 127.0.0.1 (stopped by PID, exits
with its parent); `ImageEngineClient` is the text engines' HTTP client (engines/http.py: the
weight routes, versions, checksums, the run's key) plus `rollout`, so the weight transports push
to it as to any engine server.
"""

from __future__ import annotations

import sys

import httpx

from miles_core.diffusion.server import IMAGE_SERVER_ROUTES
from miles_core.diffusion.wire import RolloutOutput, RolloutRequest
from miles_core.engines.http import EngineProcess, HttpEngine, error_message
from miles_core.engines.protocol import EngineRequestRejected, ProcessUnavailable


class ImageEngineProcess(EngineProcess):
    what = "image engine"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_core.diffusion.server",
            "--model",
            self.model_dir,
            *self.port_args(),
            *self.args,
            *(["--weight-roots", *self.weight_roots] if self.weight_roots else []),
        ]


class ImageEngineClient(HttpEngine):
    def __init__(self, url: str, api_key: str | None = None, request_timeout: float = 600.0):
        super().__init__(
            url,
            concurrency=1,
            request_timeout=request_timeout,
            weight_routes=IMAGE_SERVER_ROUTES,
            api_key=api_key,
        )

    def rollout(self, request: RolloutRequest) -> RolloutOutput:
        """The server's answer to `request`; a refusal (4xx) raises EngineRequestRejected with
        its reason, an unreachable server ProcessUnavailable."""
        try:
            r = self._sync.post(
                "/rollout/generate",
                json=request.model_dump(mode="json"),
                timeout=httpx.Timeout(self.request_timeout, connect=5.0),
            )
        except httpx.HTTPError as e:
            raise ProcessUnavailable(f"image engine at {self.url} failed a rollout: {e!r}") from e
        if r.status_code != 200:
            raise EngineRequestRejected(f"rollout on {self.url}: {error_message(r.text)}")
        return RolloutOutput.from_json(r.json())

    @property
    def image_size(self) -> int:
        r = self._sync.get("/get_model_info")
        r.raise_for_status()
        return int(r.json()["image_size"])
