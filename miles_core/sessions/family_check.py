"""The session server's start-up check: its TITO family must tokenize like the model the engine
serves. The engine's `/get_model_info` names the model (tokenizer) directory; the family's render
of a probe conversation must equal that tokenizer's chat template (miles_core/tito/check.py).
Without it, a wrong family answers 200 with garbage: the engine reads ids of another vocabulary."""

from __future__ import annotations

import time

import httpx

from miles_core.processes.auth import bearer
from miles_core.tito import TitoFamily
from miles_core.tito.check import check_family_matches


class FamilyMismatch(ValueError):
    """The family cannot be shown to tokenize like the engine's model."""


def engine_tokenizer_path(
    engine_url: str, timeout_s: float = 30.0, api_key: str | None = None
) -> str:
    """The tokenizer directory the engine reports (`tokenizer_path`, else `model_path`); waits
    up to `timeout_s` for an engine that is still starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(
                f"{engine_url.rstrip('/')}/get_model_info", headers=bearer(api_key), timeout=10.0
            )
            break
        except httpx.TransportError as e:
            if time.monotonic() > deadline:
                raise FamilyMismatch(
                    f"cannot reach the engine at {engine_url} to check the TITO family ({e!r}); "
                    "start the engine first, or pass --no-family-check"
                ) from e
            time.sleep(0.5)
    if r.status_code == 401:
        raise FamilyMismatch(
            f"the engine at {engine_url} refused the session server's key (HTTP 401): start "
            "both with the same MILES_API_KEY"
        )
    info = r.json() if r.status_code == 200 else {}
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise FamilyMismatch(
            f"the engine at {engine_url} does not name its model (GET /get_model_info answered "
            f"HTTP {r.status_code}); pass --no-family-check to serve without the check"
        )
    return str(path)


def check_engine_family(
    engine_url: str, family: TitoFamily, name: str, api_key: str | None = None
) -> None:
    """FamilyMismatch unless `family` renders like the tokenizer of the engine's model."""
    from transformers import AutoTokenizer

    path = engine_tokenizer_path(engine_url, api_key=api_key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise FamilyMismatch(
            f"cannot load the tokenizer of the engine's model {path!r} to check the TITO family "
            f"({e}); pass --no-family-check to serve without the check"
        ) from e
    try:
        check_family_matches(family, tokenizer, "--family", f"the engine's model {path}", name)
    except ValueError as e:
        raise FamilyMismatch(str(e)) from e
