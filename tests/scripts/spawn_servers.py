"""Starts an engine server and a session server (as a run does), prints their PIDs as one JSON
line, then idles until killed: tests/test_orphans.py kills it with SIGKILL."""

import json
import sys
import time

from miles_core.rollout.http_engine import EngineProcess
from miles_core.sessions import SessionServerProcess

if __name__ == "__main__":
    engine = EngineProcess(sys.argv[1], args=["--threads", "1"]).start()
    sessions = SessionServerProcess(engine.url, "tiny").start()
    print(json.dumps({"engine": engine.pid, "sessions": sessions.pid}), flush=True)
    while True:
        time.sleep(60)
