"""Claims a run name when told, holds it until its stdin closes, then releases it.

    python hold_run_lock.py ROOT NAME [STORAGE_OPTIONS_JSON]
prints `ready`, waits for a line on stdin (the start signal, so several start together), claims,
prints one JSON line {"pid", "claimed", "error"}, and waits for EOF before releasing."""

import json
import os
import sys

from miles_core.checkpoint.run_lock import RunClaim, RunLocked

root, name = sys.argv[1], sys.argv[2]
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
print("ready", flush=True)
sys.stdin.readline()
try:
    claim = RunClaim(root, [name], options)
except RunLocked as e:
    print(json.dumps({"pid": os.getpid(), "claimed": False, "error": str(e)}), flush=True)
    sys.stdin.read()
    sys.exit(0)
print(json.dumps({"pid": os.getpid(), "claimed": True, "error": None}), flush=True)
sys.stdin.read()
claim.release()
