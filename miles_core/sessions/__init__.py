"""Token-faithful agent sessions: an OpenAI-compatible session server in front of an engine
(server.py), the trajectory tree it records (trajectory.py), and its subprocess handle."""

from __future__ import annotations

import sys
from pathlib import Path

from miles_core.processes.managed import ManagedProcess
from miles_core.processes.ports import PortRange


class SessionServerProcess(ManagedProcess):
    """`miles_core.sessions.server` as a subprocess on 127.0.0.1, stopped by PID."""

    what = "session server"
    reports_port = True  # binds port 0 (or in `port_range`) itself and reports it

    def __init__(
        self,
        engine_url: str,
        family: str = "tiny",
        port: int | None = None,
        log_path: str | Path | None = None,
        args: tuple[str, ...] = (),
        port_range: PortRange | str | None = None,
        api_key: str | None = None,
    ):
        # `api_key`: required from its clients and sent to the engine (one key per run)
        super().__init__(port, log_path, port_range=port_range, api_key=api_key)
        self.engine_url = engine_url
        self.family = family
        self.args = list(args)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_core.sessions.server",
            "--engine-url",
            self.engine_url,
            "--family",
            self.family,
            *self.port_args(),
            *self.args,
        ]
