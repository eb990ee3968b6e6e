"""Task sets built on the sandbox environments, one module per family registering its sets
(`data/tasks.py: TASKS`): `terminal.py` holds `terminal`, `terminal_basics`, `terminal_detours`."""
