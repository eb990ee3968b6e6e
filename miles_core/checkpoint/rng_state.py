"""Random-number states a checkpoint carries, as JSON: the trainer process's torch CPU generator,
Python's `random`, numpy's global generator (when numpy is loaded), and an in-process engine's
own `torch.Generator`.

Today the loop draws from none of the process-global ones after start-up (dropout is 0, every
engine-server request carries its own sampling seed), but a plug-in (task, reward, agent) may,
and a resumed run must continue their streams where they stopped, not from their seeds.
"""

from __future__ import annotations

import base64
import random
import sys

import torch


def encode_generator(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def decode_generator(generator: torch.Generator, encoded: str) -> None:
    raw = bytearray(base64.b64decode(encoded))
    generator.set_state(torch.frombuffer(raw, dtype=torch.uint8))


def capture() -> dict:
    """This process's global RNG states."""
    version, internal, gauss = random.getstate()
    state: dict = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore(state: dict) -> None:
    """Sets the global RNG states `capture` returned (keys it lacks are left alone)."""
    if "torch" in state:
        raw = bytearray(base64.b64decode(state["torch"]))
        torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8))
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = np.array(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
