"""`make venv`'s last step: import what run and test processes import, once, so that its
byte-code is compiled into .venv/pycache (PYTHONPYCACHEPREFIX) before processes start side by
side. On a fresh clone each of them would otherwise compile the same modules (about 12 CPU-s
per process for this set), several at once when the test workers, their engine servers and
trainer ranks start together."""

from __future__ import annotations

import importlib
import time

MODULES = (
    "flows.cli",
    "flows.rl_train",
    "flows.sft",
    "miles_core.run.runtime",
    "miles_core.train.backends.fsdp",
    "miles_core.train.backends.megatron.backend",
    "miles_core.engines.cpu.server",
    "miles_core.sessions.server",
    "miles_core.precision.convert",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "mlflow",
    "prefect",
    "safetensors.torch",
    "httpx",
    "uvicorn",
    "pytest",
)


def main() -> None:
    t0 = time.monotonic()
    for name in MODULES:
        importlib.import_module(name)
    print(
        f"compiled the byte-code of {len(MODULES)} entry modules in {time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
