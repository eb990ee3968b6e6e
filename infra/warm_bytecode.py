"""`make venv`'s last step: `python -m infra.warm_bytecode` imports what runs and servers import,
in two processes at once, so each module is compiled once into the byte-code cache
(`PYTHONPYCACHEPREFIX`, .venv/pycache under make) before anything else starts.

The install compiles nothing (infra/install.py); without this step the first processes of a
fresh checkout (the test workers, the runs and servers they start together, the demo's first
run) each compiled torch, transformers, MLflow and Prefect at the same time, the same modules
several times over. A module that fails to import is reported and skipped: warming is an
optimisation, the import error shows where the module is used.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import warnings

# two groups of about equal compile time: the trainer's side, the orchestration's side
GROUPS = (
    (
        "miles_core.runtime",
        "miles_core.engine.server",
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "megatron.core",
        "torch.distributed.checkpoint",
    ),
    (
        "flows.cli",
        "flows.rl_train",
        "flows.sft",
        "flows.evaluate",
        "miles_core.sessions.server",
        "mlflow.store.tracking.sqlalchemy_store",
        "mlflow.store.model_registry.sqlalchemy_store",
        "prefect.server.api.server",
        "uvicorn",
        "matplotlib.figure",
        "matplotlib.backends.backend_agg",
    ),
)


def import_all(names: tuple[str, ...]) -> int:
    warnings.simplefilter("ignore")  # what a module warns about at import shows where it is used
    failed = 0
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (reported; the module's users show the error)
            print(f"warm_bytecode: {name}: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
    return failed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:  # one group, in a child
        return import_all(GROUPS[int(args[0])])
    t0 = time.perf_counter()
    children = [
        subprocess.Popen([sys.executable, "-m", "infra.warm_bytecode", str(i)])
        for i in range(len(GROUPS))
    ]
    failed = sum(child.wait() for child in children)
    print(
        f"byte-code cache warmed in {time.perf_counter() - t0:.0f} s"
        + (f" ({failed} modules failed to import)" if failed else ""),
        file=sys.stderr,
    )
    return 0  # never fails the install


if __name__ == "__main__":
    sys.exit(main())
