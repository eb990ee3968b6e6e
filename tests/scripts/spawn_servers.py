"""Starts an engine server, sglang-router in front of it and a session server (as a run does),
prints their PIDs as one JSON line, then idles until killed: tests/test_orphans.py kills it with
SIGKILL."""

import json
import sys
import time

from miles_core.engines.http import EngineProcess
from miles_core.engines.router import RouterProcess
from miles_core.sessions import SessionServerProcess

if __name__ == "__main__":
    engine = EngineProcess(sys.argv[1], args=["--threads", "1"]).start()
    router = RouterProcess([engine.url]).start()
    sessions = SessionServerProcess(router.url, "tiny").start()
    pids = {"engine": engine.pid, "router": router.pid, "sessions": sessions.pid}
    print(json.dumps(pids), flush=True)
    while True:
        time.sleep(60)
