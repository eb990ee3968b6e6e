"""Preflight refuses, before anything starts (no checkpoint folder, no MLflow store, no Prefect
call), what used to pass it and fail later (issue 14): a corrupt or truncated safetensors file, a
model too big for the machine (`vocab_size` 1e8), a tracking URI MLflow cannot open, non-finite
numbers, unknown chat roles, YAML syntax errors and plug-ins that raise at import; the CLI exits
2 with the file and line, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from flows import cli
from miles_core.config import load_config
from miles_core.run.preflight import preflight


@pytest.fixture
def quiet_cwd(tmp_path, monkeypatch):
    """A fresh cwd (where a run would create ./mlflow.db) and a Prefect API no call reaches."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def _refused(capsys, args: list[str], message: str, root: Path) -> str:
    """`miles train ARGS` in this process: exit 2 with `message`, nothing created."""
    code = cli.main(["train", *args, "--set", f"checkpoint.root={root}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err
    assert not root.exists() or not any(p.name != ".locks" for p in root.iterdir())
    assert not (Path.cwd() / "mlflow.db").exists()
    return err


def _model_copy(tiny_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_dir, dest)
    return dest


def test_a_corrupt_or_truncated_safetensors_file_is_refused(tiny_dir, tmp_path, quiet_cwd, capsys):
    weights = "model.safetensors"
    truncated = _model_copy(tiny_dir, tmp_path / "truncated")
    data = (truncated / weights).read_bytes()
    (truncated / weights).write_bytes(data[:-100])
    _refused(
        capsys,
        ["--set", f"model.path={truncated}"],
        f"{truncated / weights}: truncated or corrupt: the header describes {len(data)} bytes, "
        f"the file has {len(data) - 100}",
        tmp_path / "ckpt",
    )
    garbage = _model_copy(tiny_dir, tmp_path / "garbage")
    (garbage / weights).write_bytes(b"\xff" * 4096)
    _refused(
        capsys, ["--set", f"model.path={garbage}"], "not a safetensors file", tmp_path / "ckpt"
    )
    empty = _model_copy(tiny_dir, tmp_path / "empty")
    (empty / weights).write_bytes(b"")
    _refused(
        capsys,
        ["--set", f"model.path={empty}"],
        "not a safetensors file (0 bytes)",
        tmp_path / "ckpt",
    )


def test_a_model_too_big_for_the_machine_is_refused_without_allocating(
    tiny_dir, tmp_path, quiet_cwd, capsys
):
    """Issue 14: `vocab_size` 1e8 passed preflight and the run tried to allocate 25.6 GB."""
    huge = _model_copy(tiny_dir, tmp_path / "huge")
    cfg = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1e8}))
    rss = psutil.Process().memory_info().rss
    err = _refused(
        capsys,
        ["--set", f"model.path={huge}", "--set", "train.device=cpu"],
        "parameters; training it needs at least ≈",
        tmp_path / "ckpt",
    )
    params = float(err.split("has ≈")[1].split(" parameters")[0])
    assert params >= 1e8 * cfg["hidden_size"]  # the embedding alone
    assert "GiB available" in err
    assert psutil.Process().memory_info().rss - rss < 256 << 20  # nothing was built
    # a config that disagrees with its weights is refused too (sizes and shapes)
    (huge / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    _refused(
        capsys,
        ["--set", f"model.path={huge}"],
        f"model.embed_tokens.weight is [{cfg['vocab_size']}, {cfg['hidden_size']}], but "
        "config.json says vocab_size 1000",
        tmp_path / "ckpt",
    )
    (huge / "config.json").write_text(json.dumps({**cfg, "hidden_size": -4}))
    _refused(
        capsys,
        ["--set", f"model.path={huge}"],
        "config.json hidden_size must be a positive integer, got -4",
        tmp_path / "ckpt",
    )


def test_a_tracking_uri_mlflow_cannot_open_is_refused(tmp_path, quiet_cwd, capsys, monkeypatch):
    _refused(
        capsys,
        ["--set", "tracking.tracking_uri=bogus://x"],
        "tracking.tracking_uri 'bogus://x': MLflow has no tracking store for scheme 'bogus'",
        tmp_path / "ckpt",
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://from-env")
    _refused(
        capsys,
        [],
        "($MLFLOW_TRACKING_URI) 'bogus://from-env': MLflow has no tracking store",
        tmp_path / "ckpt",
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    _refused(
        capsys,
        ["--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/no/such/dir/mlflow.db"],
        "does not exist",
        tmp_path / "ckpt",
    )


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_in_the_config_are_refused(value):
    """Issue 14: `train.lr: .inf` was accepted and the weights turned NaN."""
    with pytest.raises(ValidationError, match="train.lr\n  Input should be a finite number"):
        load_config(None, [f"train.lr={value}"])
    with pytest.raises(ValidationError, match="Input should be a finite number"):
        load_config(None, [f"rollout.temperature={value}"])


def test_an_unknown_chat_role_is_refused(tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "say a"}]})
        + "\n"
        + json.dumps(
            {"prompt": [{"role": "system", "content": "x"}, {"role": "bogus", "content": "hi"}]}
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"row 2: message 2 has role 'bogus'; known: system, user"):
        preflight(load_config(None, [f"data.path={rows}", f"checkpoint.root={tmp_path / 'c'}"]))


def test_yaml_syntax_errors_exit_2_with_the_file_and_line(tmp_path, quiet_cwd, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  lr: [1e-3\n  num_steps: 2\n")
    code = cli.main(["train", "--config", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and f"miles: error: {bad}: not valid YAML: line 4, column" in err, err
    assert "Traceback" not in err
    code = cli.main(["train", "--set", "train.lr=[1"])
    err = capsys.readouterr().err
    assert code == 2 and "--set 'train.lr=[1': the value is not valid YAML (line 1, column" in err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_plugin_that_raises_at_import_exits_2_with_its_file_and_line(
    tmp_path, quiet_cwd, capsys, monkeypatch
):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "raising_task.py").write_text("import os\nraise RuntimeError('boom at import')\n")
    (plugins / "broken_task.py").write_text("def f(:\n    pass\n")
    (plugins / "needs_dep.py").write_text("import os\nimport no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(plugins))
    err = _refused(
        capsys,
        ["--set", "data.task=raising_task:Task"],
        f"{plugins / 'raising_task.py'}:2: RuntimeError: boom at import",
        tmp_path / "ckpt",
    )
    assert "cannot import task 'raising_task:Task'" in err
    _refused(
        capsys,
        ["--set", "data.task=broken_task:Task"],
        f"{plugins / 'broken_task.py'}:1: SyntaxError",
        tmp_path / "ckpt",
    )
    _refused(  # its own import fails: its line, not "no module 'needs_dep'"
        capsys,
        ["--set", "data.task=needs_dep:Task"],
        f"{plugins / 'needs_dep.py'}:2: ModuleNotFoundError: No module named 'no_such_dependency_xyz'",
        tmp_path / "ckpt",
    )
