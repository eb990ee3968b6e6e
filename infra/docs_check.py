"""`make docs-check`'s site build: `python -m infra.docs_check [mkdocs.yml]` builds the user docs
strictly into a temporary folder and fails on any warning mkdocs reports (a broken link, an
anchor a page does not have, a page missing from the nav).

mkdocs' `--quiet` raises its log level above WARNING, so with it `--strict` counts no warnings and
a broken link passes; this runs the build at its normal level and shows only the warnings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build(config_file: Path) -> tuple[int, list[str]]:
    """Builds the site of `config_file` strictly into a temporary folder: the exit status and
    every WARNING or ERROR line mkdocs printed."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    command = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    with tempfile.TemporaryDirectory() as site:
        done = subprocess.run(
            [*command, "build", "--strict", "--config-file", str(config_file), "--site-dir", site],
            capture_output=True,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
    output = (done.stdout + done.stderr).splitlines()
    problems = [line for line in output if line.startswith(("WARNING", "ERROR", "Aborted"))]
    if done.returncode != 0 and not problems:
        problems = output[-20:]
    return done.returncode, problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config_file = Path(args[0]) if args else REPO / "mkdocs.yml"
    code, problems = build(config_file)
    for line in problems:
        print(line, file=sys.stderr)
    if code == 0 and problems:  # a warning strict mode did not count is still a failure
        code = 1
    print(f"docs: {'built strictly' if code == 0 else 'FAILED'} ({config_file})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
