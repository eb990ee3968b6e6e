"""The exit of a server process whose own shutdown is complete.

With torch loaded, the interpreter's teardown (C-extension finalizers, after every atexit
handler) takes about a second of an engine server's exit, spent after the server stopped
serving: every stop and every replacement of a server waited for it. A server's `__main__`
runs `exit_after(main)`: once `main` returns (or raises SystemExit), the atexit handlers run
and the standard streams are flushed as in a normal exit, then the process ends without the
teardown. An uncaught exception takes the normal path (traceback, full teardown).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def exit_after(main: Callable[[], object]) -> NoReturn:
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): the message on stderr, status 1 (as Python does)
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()  # logging.shutdown among them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
