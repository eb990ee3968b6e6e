"""Reading a run configuration: a YAML file plus `--set dotted.key=value` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from miles_core.config.run import RunConfig


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects dotted.key=value, got {item!r}")
        key, _, raw = item.partition("=")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(
                f"--set {item!r}: the value is not valid YAML ({_yaml_error(e)})"
            ) from e
        out.append((key.strip(), value))
    return out


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error as 'line L, column C: problem' (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Reads a YAML file, applies `dotted.key=value` overrides (values parsed as YAML), validates."""
    tree: dict = {}
    if path is not None:
        with open(path) as f:
            try:
                tree = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {_yaml_error(e)}") from e
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    return RunConfig.model_validate(tree)
