"""`make venv`'s installer: `python -m infra.install '.[test,server]'` installs the project with
its extras into the running interpreter's venv.

It uses uv (parallel downloads and unpacking: ≈15 s where pip takes ≈150 s on two cores),
configured from pip's own configuration (`pip config list`: pip.conf files and
`PIP_*` variables), so that it installs from the same indexes, local wheel folders and
constraints as `pip install` would, with pip's rule of the best version across all indexes.
When uv cannot be installed or fails, pip does the install. Neither byte-compiles: byte-compiling
all 27,000 modules took 30–105 s here, mostly writing files, and a run imports a fraction of them;
the Makefile has each module compiled on its first import instead (`PYTHONPYCACHEPREFIX`). Only
the standard library: it runs before anything else is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

# pip option (as `pip config list` names it) -> uv flag, for options with one or more values
LIST_OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# pip option -> environment variable uv reads
ENV_OPTIONS = {
    "cert": "SSL_CERT_FILE",
    "timeout": "UV_HTTP_TIMEOUT",
    "default-timeout": "UV_HTTP_TIMEOUT",
    "proxy": "HTTPS_PROXY",
}
# later sections win, as in pip: global < install < environment variables
SECTIONS = ("global", "install", ":env:")
UV = "uv==0.13.9"  # pinned: the installer's behaviour does not change under a clean clone


def pip_options(listing: str) -> dict[str, str]:
    """The effective value of each pip option from `pip config list` output
    (`section.key='value'` lines)."""
    found: dict[str, dict[str, str]] = {s: {} for s in SECTIONS}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if sep and dot and section in found:
            found[section][key] = value.strip().strip("'\"")
    merged: dict[str, str] = {}
    for section in SECTIONS:
        merged.update(found[section])
    return merged


def uv_arguments(options: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv flags and environment variables equivalent to pip's options."""
    args: list[str] = []
    for key, flag in LIST_OPTIONS.items():
        for value in options.get(key, "").split():
            args += [flag, value]
    if options.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        args.append("--no-index")
    env = {var: options[key] for key, var in ENV_OPTIONS.items() if options.get(key)}
    return args, env


def _run(cmd: list[str], env: dict[str, str] | None = None) -> bool:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode == 0


def install(requirement: str) -> int:
    python = sys.executable
    listing = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    args, env = uv_arguments(pip_options(listing))
    if _run([python, "-m", "pip", "install", "-q", UV]):
        uv = [python, "-m", "uv", "pip", "install", "--quiet", "--python", python]
        # pip's rule: the best version across every index, not uv's first index that has it
        uv += ["--index-strategy", "unsafe-best-match", *args]
        if _run([*uv, "-e", requirement], {**os.environ, **env}):
            return 0
        print("uv failed; installing with pip", file=sys.stderr)
    else:
        print("could not install uv; installing with pip", file=sys.stderr)
    _run([python, "-m", "pip", "install", "-q", "-U", "pip"])  # an old pip resolves slowly
    return (
        0 if _run([python, "-m", "pip", "install", "-q", "--no-compile", "-e", requirement]) else 1
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m infra.install '.[extra,...]'")
    sys.exit(install(sys.argv[1]))
