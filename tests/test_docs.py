"""The user docs and the benchmark results files: each benchmark records its figures in one
place (benchmarks/results/<name>.json), the tables in docs/benchmarks.md are generated from them,
and the README's links lead somewhere. (`make test` also runs `mkdocs build --strict`.)"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
BENCHMARKS = sorted(
    p.stem for p in BENCH.glob("*.py") if p.stem not in ("record", "render_results")
)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded_names(script: Path) -> set[str]:
    """The names a benchmark passes to record_result."""
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "record_result"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def test_every_benchmark_records_its_results_under_its_own_name_and_has_a_docs_table():
    """`<name>.py` records `<name>`, and may record `<name>_<machine>` beside it (e.g. _gpu)."""
    render = _module("render_results")
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    assert BENCHMARKS, "no benchmarks found"
    for name in BENCHMARKS:
        recorded = _recorded_names(BENCH / f"{name}.py")
        assert name in recorded, f"{name}.py does not record_result({name!r}, ...)"
        for each in recorded:
            assert each == name or each.startswith(f"{name}_"), f"{name}.py records {each!r}"
            assert f"<!-- results:{each} -->" in docs, f"docs/benchmarks.md has no table for {each}"
            assert each in render.RENDERERS, f"render_results.py has no renderer for {each}"


def test_the_benchmark_tables_in_the_docs_match_the_results_files():
    render = _module("render_results")
    assert render.problems(render.DOCS.read_text()) == []
    for path in sorted(render.RESULTS_DIR.glob("*.json")):
        payload = json.loads(path.read_text())
        assert payload["benchmark"] == path.stem
        assert {"command", "measured_at", "source", "git_commit", "machine", "result"} <= set(
            payload
        )


def test_a_stale_or_missing_table_is_reported(tmp_path):
    render = _module("render_results")
    (tmp_path / "weight_sync.json").write_text(
        (render.RESULTS_DIR / "weight_sync.json").read_text()
    )
    (tmp_path / "new_bench.json").write_text(
        json.dumps({"benchmark": "new_bench", "result": {"x": 1}, "measured_at": "2027-01-01"})
    )
    stale = "# B\n<!-- results:weight_sync -->\nold figures\n<!-- /results:weight_sync -->\n"
    found = render.problems(stale, tmp_path)
    assert any("new_bench.json has no" in p for p in found)
    assert any("stale" in p for p in found)
    fresh = render.render_text(stale, tmp_path)
    assert "old figures" not in fresh and "| small |" in fresh
    assert render.problems(fresh, tmp_path) == [found[0]]  # only the missing block is left


def test_record_result_writes_the_figures_with_their_provenance(tmp_path, monkeypatch):
    record = _module("record")
    docs_before = (REPO / "docs" / "benchmarks.md").read_text()
    result = {"fraction_of_memcpy": {"small": {"disk": 0.03}}}
    path = record.record_result("weight_sync", result, directory=tmp_path)
    assert path == tmp_path / "weight_sync.json"
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == "weight_sync"
    assert payload["result"] == result
    assert payload["source"] == "measured by the benchmark"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", payload["measured_at"])
    assert re.fullmatch(r"[0-9a-f]{40}", payload["git_commit"]["sha"] or "")
    assert payload["machine"]["cpus"] >= 1 and payload["machine"]["python"]
    # a write outside benchmarks/results leaves the recorded figures and the docs alone
    assert (REPO / "docs" / "benchmarks.md").read_text() == docs_before


def test_readme_is_a_short_guide_whose_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links onward to docs/"
    for link in local:
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"


@pytest.mark.parametrize("page", sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_every_docs_page_is_in_the_nav(page):
    nav = (REPO / "mkdocs.yml").read_text()
    assert f": {page}" in nav, f"docs/{page} is not in mkdocs.yml's nav"


@pytest.mark.slow
def test_a_broken_link_or_anchor_fails_the_docs_check(tmp_path, capsys):
    """`make docs-check`'s build (infra/docs_check.py) on a copy of the docs with one link to a
    missing page and one to a missing anchor: both reported, and the check fails (mkdocs'
    `--strict --quiet` passed such a build)."""
    from infra import docs_check

    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    shutil.copy(REPO / "ARCHITECTURE.md", tmp_path)
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "tests" / "test_bad_input.py", tmp_path / "tests")
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\nSee [gone](no-such-page.md) and [tasks](tasks.md#no-such-section).\n")
    assert docs_check.main([str(tmp_path / "mkdocs.yml")]) != 0
    report = capsys.readouterr().err
    assert "no-such-page.md" in report and "#no-such-section" in report
