"""mkdocs hooks: pages generated from the code, so they cannot drift from it.

- `architecture.md` is the top-level ARCHITECTURE.md (the 30-minute code tour stays beside the
  code; the site shows it too), its links into docs/ made relative to the site's pages.
- `<!-- config-reference -->` in a page becomes one table per section of `RunConfig`: every
  field with its type, default, bounds and description, read from the pydantic models.
- `<!-- bad-input-catalogue -->` becomes the table of `CATALOGUE` in tests/test_bad_input.py
  (each class of bad input, what the user gets, the test that shows it).
"""

from __future__ import annotations

import ast
import re
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent


def on_files(files, config):
    files.append(File.generated(config, "architecture.md", content=site_architecture()))
    return files


def site_architecture() -> str:
    """ARCHITECTURE.md as a page of the site: a link to `docs/x.md` (right beside the code, where
    the file lives) becomes `x.md` (the site's pages are docs/'s files)."""
    return re.sub(r"\]\(docs/", "](", (REPO / "ARCHITECTURE.md").read_text())


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- config-reference -->" in markdown:
        markdown = markdown.replace("<!-- config-reference -->", config_reference())
    if "<!-- bad-input-catalogue -->" in markdown:
        markdown = markdown.replace("<!-- bad-input-catalogue -->", bad_input_catalogue())
    return markdown


# ------------------------------------------------------------------------------ config reference
def config_reference() -> str:
    from pydantic import BaseModel

    from miles_core.config import RunConfig

    top: list[list[str]] = []
    sections: list[tuple[str, type[BaseModel], str]] = []
    for name, field in RunConfig.model_fields.items():
        model = _model_of(field.annotation)
        if model is None:
            top.append(_row(name, field))
        else:
            sections.append((name, model, field.description or ""))
    out = ["### Top level", "", *_table(top), ""]
    for name, model, description in sections:
        rows: list[list[str]] = []
        _collect(model, name, rows)
        doc = (model.__doc__ or "").strip()
        intro = " ".join(x for x in (description, doc) if x and "Usage docs" not in x)
        out += [f"### `{name}`", ""]
        if intro:
            out += [_cell(intro), ""]
        out += [*_table(rows), ""]
    return "\n".join(out + plugin_options_reference())


def _options_note(field) -> str:
    return f"{field.description}; see [plug-in options](#plug-in-options)"


def plugin_options_reference() -> list[str]:
    """One table per built-in plug-in that has options, under the key that holds them."""
    from miles_core.engines.registry import ENGINES
    from miles_core.eval.mode import EVAL_MODES
    from miles_core.plugins import NoOptions
    from miles_core.rollout.mode import MODES
    from miles_core.train.advantage import ADVANTAGES
    from miles_core.train.backend import BACKENDS
    from miles_core.train.loss import LOSSES
    from miles_core.weights.transport import TRANSPORTS

    out = ["### Plug-in options", ""]
    out.append(
        "A plug-in chosen by name takes its own settings under the key's `*_options` "
        "(validated against its `Options` class; unknown keys are refused). The built-ins "
        "that have some:"
    )
    out.append("")
    for registry in (ENGINES, MODES, TRANSPORTS, BACKENDS, LOSSES, ADVANTAGES, EVAL_MODES):
        for name in registry.names():
            options = getattr(registry.get(name), "Options", NoOptions)
            if options is NoOptions:
                continue
            rows: list[list[str]] = []
            _collect(options, f"{registry.setting}_options", rows)
            out += [f"#### `{registry.setting}: {name}`", "", *_table(rows), ""]
    return out


def _collect(model, prefix: str, rows: list[list[str]]) -> None:
    from miles_core.plugins import PluginOptions

    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        dotted = f"{prefix}.{name}"
        if sub is PluginOptions:  # a plug-in's own settings: listed per plug-in below
            rows.append([f"`{dotted}`", "mapping", "`{}`", "", _cell(_options_note(field))])
        elif sub is not None:
            _collect(sub, dotted, rows)
        else:
            rows.append(_row(dotted, field))


def _model_of(annotation: Any):
    from pydantic import BaseModel

    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def _row(name: str, field) -> list[str]:
    return [
        f"`{name}`",
        _type(field.annotation),
        _default(field),
        _bounds(field),
        _cell(field.description or ""),
    ]


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        args = ", ".join(_type(a).strip("`") for a in typing.get_args(annotation))
        return f"`{name}[{args}]`"
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "null"
    if hasattr(value, "model_dump"):
        return "(section)"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _bounds(field) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    out = []
    for m in field.metadata:
        for attr, sign in signs.items():
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {v}")
        pattern = getattr(m, "pattern", None)
        if pattern:
            out.append(f"`{pattern}`")
    return ", ".join(out)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: list[list[str]]) -> list[str]:
    head = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    return head + ["| " + " | ".join(r) + " |" for r in rows]


# ---------------------------------------------------------------------------- bad-input catalogue
def bad_input_catalogue() -> str:
    tree = ast.parse((REPO / "tests" / "test_bad_input.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CATALOGUE" for t in node.targets
        ):
            entries = ast.literal_eval(node.value)
            break
    else:
        raise RuntimeError("tests/test_bad_input.py has no CATALOGUE")
    lines = [
        f"{len(entries)} classes of bad input; each row names the test that shows it "
        "(`tests/test_bad_input.py` checks that every named test exists).",
        "",
        "| bad input | what you get | shown by |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(a)} | {_cell(b)} | `tests/{c}` |" for a, b, c in entries]
    return "\n".join(lines)
