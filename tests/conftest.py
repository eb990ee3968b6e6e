from __future__ import annotations

import os
from pathlib import Path

import pytest

import miles_core  # noqa: F401  (applies env defaults: offline hub, no telemetry)
from miles_core.models import build_model, save_hf_dir

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_HOME", str(REPO / ".prefect"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A seeded tiny Qwen3 model + tokenizer saved as an HF directory."""
    model, tok = build_model("tiny", seed=0)
    return save_hf_dir(model, tok, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from miles_core.models import load_hf_dir

    return load_hf_dir(tiny_dir)
