"""Where a benchmark's figures live: `benchmarks/results/<name>.json`, written by the benchmark.

Every benchmark ends with `record_result(name, result)`: its final JSON object (the one it prints
as its last line) goes to `benchmarks/results/<name>.json` together with the machine it ran on,
the git commit, the command line and the date, and the tables in docs/benchmarks.md are
regenerated from all results files (`render_results.py`). So a benchmark's figures are stated in
one place, by the benchmark itself, and the docs show the newest run.

`MILES_BENCH_RESULTS_DIR` writes the file elsewhere (and leaves the docs alone), e.g. for a trial
run whose figures should not replace the recorded ones.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
REPO = HERE.parent


def machine_info() -> dict[str, Any]:
    """The machine a figure was measured on: CPU, cores usable, memory, Python, torch, GPU."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        # the vector ISA torch's CPU kernels use (AVX2, AVX512, ...) and whether oneDNN has bf16
        # GEMMs: the same core count gives 2× apart figures on another ISA
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        from miles_core.device import bf16_gemms_native

        info["cpu_bf16_gemms"] = bf16_gemms_native(torch.device("cpu"))
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _render_results():
    """benchmarks/render_results.py as a module (benchmarks/ is a folder of scripts, no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_results", HERE / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_commit(repo: Path = REPO) -> dict[str, Any]:
    """HEAD's sha and whether the tree had uncommitted changes (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def record_result(name: str, result: dict[str, Any], directory: str | Path | None = None) -> Path:
    """Write `result` with its provenance to `<directory>/<name>.json`; re-render the docs tables.

    The default directory is benchmarks/results (or `$MILES_BENCH_RESULTS_DIR`); only a write
    there regenerates docs/benchmarks.md.
    """
    env_dir = os.environ.get("MILES_BENCH_RESULTS_DIR")
    target = Path(directory or env_dir or RESULTS_DIR)
    payload = {
        "benchmark": name,
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "measured_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": "measured by the benchmark",
        "git_commit": git_commit(),
        "machine": machine_info(),
        "result": result,
    }
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    if target.resolve() == RESULTS_DIR.resolve():
        _render_results().render_docs()
    print(f"results written to {path}", file=sys.stderr)
    return path
