"""Wall-clock marks of a run's phases, for a harness that times the run from outside
(benchmarks/time_to_result.py): with `MILES_TIMELINE=<file>` set, `mark(event)` appends one JSON
line `{"event", "t" (time.time()), "pid"}`; unset, it does nothing. The events a CLI run marks:
`main` (the command's module imported), `preflight` (its inputs checked), `api_ready` (the Prefect
API answers), `steps_start` (setup done: tracking, model, runtime), `steps_end`, `summary` (the
result printed)."""

from __future__ import annotations

import json
import os
import time

ENV = "MILES_TIMELINE"


def mark(event: str) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid()})
    with open(path, "a") as f:
        f.write(line + "\n")
