"""`make ui-check`: headless Chromium screenshots of the real UIs after two tiny training runs.

    1. Debian `chromium` (installed with apt-get when missing)
    2. the local stack (`.local-stack/`, or $MILES_STACK_DIR): used when up, else started and
       stopped again at the end (only the services this script started)
    3. `deployments/serve.py`, then two tiny say_a runs (lr 3e-3 and 1e-2) and a tiny
       fully_async run (engine server, shared-memory pushes, shared evaluation) triggered
       through the Prefect REST API like the UI's "Custom run"; all must complete
    4. screenshots into `ui-check/`: the Prefect flow-run page of the first run and of the async
       run (its long-running task runs side by side in the run graph), the training
       deployment's run form (the RunConfig parameter), MLflow's compare-runs page and the
       `rollout/reward_mean` chart of the two sync runs; each page's rendered text is checked
       (names, states, no error banner) and each PNG for colours and non-background pixels

Exit code 0 when every run completed and every screenshot passed the check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from infra import local_stack
from infra.processes import (
    api_call,
    descendants,
    stop_group,
    stop_serving_process,
    tail,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "ui-check"
EXPERIMENT = "ui-check"
RUNS = {"ui-check-a": 3e-3, "ui-check-b": 1e-2}  # run name -> learning rate
ASYNC_RUN = "ui-check-async"  # fully_async: the long-running tasks of flows/rl_loops.py
LOOP_TASKS = ("rollout_loop", "train_loop", "weight_update_loop")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# ms of virtual time Chromium lets the page run before the shot (the SPAs fetch, then render)
VIRTUAL_TIME_MS = int(os.environ.get("MILES_UI_CHECK_WAIT_MS", "20000"))
# error banners of the two UIs (Prefect: no API; MLflow: a bad route or failed fetch)
ERROR_TEXTS = (
    "Something went wrong",
    "connect to Server API",
    "Error while loading",
    "invalid URL",
)


class CheckFailed(RuntimeError):
    pass


def ensure_chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    print("installing Debian chromium (apt-get install -y chromium) ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    install = [*sudo, "apt-get", "install", "-y", "-q", "chromium"]
    if subprocess.run(install, env=env).returncode != 0:
        subprocess.run([*sudo, "apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(install, env=env, check=True)
    found = shutil.which("chromium")
    if not found:
        raise CheckFailed("chromium is not on PATH after apt-get install chromium")
    return found


def tiny_config(name: str, lr: float, client_env: dict[str, str]) -> dict:
    return {
        "name": name,
        "model": {"preset": "tiny"},
        "data": {"task": "say_a"},
        "rollout": {"prompts_per_step": 8, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        "train": {"num_steps": 12, "global_batch_size": 32, "micro_batch_size": 32, "lr": lr},
        "checkpoint": {
            "root": client_env["MILES_CHECKPOINT_ROOT"],
            "interval": 6,
            "overwrite": True,
        },
        "tracking": {"tracking_uri": client_env["MLFLOW_TRACKING_URI"], "experiment": EXPERIMENT},
    }


def async_config(client_env: dict[str, str]) -> dict:
    """A tiny fully_async run with a shared evaluation: the producer's, the trainer's and the
    overlapped pushes' long-running tasks."""
    config = tiny_config(ASYNC_RUN, 3e-3, client_env)
    config["rollout"] |= {
        "engine": "server",
        "engine_options": {"threads": 1},
        "mode": "fully_async",
    }
    config["weight_sync"] = {"transport": "shared_memory"}
    config["eval"] = {"mode": "shared", "every": 6, "prompts": 8}
    return config


def start_serve(client_env: dict[str, str], workdir: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        **client_env,
        "PREFECT_HOME": str(workdir / "prefect"),
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    argv = [sys.executable, str(REPO / "deployments" / "serve.py"), "--model", "ui-check-b"]
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115  (the child holds it)
    return subprocess.Popen(
        [*argv, "--interval", "3600"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        start_new_session=True,
    )


def stop_serve(proc: subprocess.Popen, seen: set[int]) -> None:
    stop_serving_process(proc, seen)


def run_trainings(
    api: str, client_env: dict[str, str], proc, seen: set[int]
) -> tuple[str, dict[str, str]]:
    """Trigger both runs on the training deployment; return its id and run name -> flow run id."""

    def deployment_id():
        if proc.poll() is not None:
            raise CheckFailed(f"serve.py exited with {proc.returncode}")
        r = api_call("GET", f"{api}/deployments/name/rl-train/train", timeout=10)
        return r.json()["id"] if r.status_code == 200 else None

    dep = wait_for(deployment_id, 120, "serve.py to register rl-train/train")
    ids = {}
    configs = {name: tiny_config(name, lr, client_env) for name, lr in RUNS.items()}
    configs[ASYNC_RUN] = async_config(client_env)
    for name, config in configs.items():
        body = {"parameters": {"config": config}}
        r = api_call("POST", f"{api}/deployments/{dep}/create_flow_run", json=body, timeout=30)
        r.raise_for_status()
        ids[name] = r.json()["id"]

    def all_done():
        seen.update(descendants(proc.pid))
        states = {
            n: api_call("GET", f"{api}/flow_runs/{i}", timeout=10).json()["state"]
            for n, i in ids.items()
        }
        return states if all(s["type"] in TERMINAL for s in states.values()) else None

    states = wait_for(all_done, 900, "the training runs")
    bad = {n: s["type"] for n, s in states.items() if s["type"] != "COMPLETED"}
    if bad:
        raise CheckFailed(f"training runs did not complete: {bad}")
    return dep, ids


def mlflow_runs(tracking_uri: str, flow_run_ids: dict[str, str]) -> tuple[str, list[str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    run_ids = []
    for name, flow_run_id in flow_run_ids.items():
        if name not in RUNS:
            continue
        (run,) = client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
        run_ids.append(run.info.run_id)
    return experiment, run_ids


def _chromium(chromium: str, url: str, *output: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="miles-chromium-") as profile:
        argv = [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1600,1000",
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            *output,
            url,
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise CheckFailed(f"chromium failed on {url}: {done.stderr[-2000:]}")
    return done


def screenshot(chromium: str, url: str, path: Path) -> None:
    _chromium(chromium, url, f"--screenshot={path}")
    if not path.exists():
        raise CheckFailed(f"chromium wrote no screenshot of {url}")


def page_text(chromium: str, url: str) -> str:
    """The text of the page as rendered (the DOM after the scripts ran), tags stripped."""
    dom = _chromium(chromium, url, "--dump-dom").stdout
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def check_text(text: str, url: str, expect: list[str]) -> None:
    """The page shows what it should (run names, states) and no error banner."""
    missing = [e for e in expect if e not in text]
    errors = [e for e in ERROR_TEXTS if e in text]
    if missing or errors:
        raise CheckFailed(
            f"{url}: missing {missing}, error text {errors}; page text: {text[:600]!r}"
        )


def check_png(path: Path, min_colours: int = 64, min_ink: float = 0.02) -> dict[str, float]:
    """A rendered page, not a blank or a lone spinner: many distinct colours, and a share of
    pixels that differ from the most common (background) colour."""
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 24) or []
        total = rgb.width * rgb.height
    background = max(colours)[0] if colours else total
    stats = {
        "width": rgb.width,
        "height": rgb.height,
        "colours": len(colours),
        "ink": 1 - background / total,
        "kib": path.stat().st_size / 1024,
    }
    if stats["colours"] < min_colours or stats["ink"] < min_ink:
        raise CheckFailed(f"{path.name} looks blank: {stats}")
    return stats


def main() -> int:
    chromium = ensure_chromium()
    cfg = local_stack.StackConfig.from_env()
    before = local_stack.status(cfg)
    started = [s for s, v in before.items() if v["state"] != "up"]
    if started:
        local_stack.up(cfg)
    cfg = local_stack.recorded_config(cfg)
    client_env = local_stack.client_env(cfg)
    api = client_env["PREFECT_API_URL"]
    prefect_ui, mlflow_ui = local_stack.urls(cfg)["prefect"], local_stack.urls(cfg)["mlflow"]
    workdir = Path(tempfile.mkdtemp(prefix="miles-ui-check-"))
    seen: set[int] = set()
    proc = start_serve(client_env, workdir)
    try:
        t0 = time.monotonic()
        deployment, flow_runs = run_trainings(api, client_env, proc, seen)
        print(f"the training runs completed in {time.monotonic() - t0:.0f} s")
        experiment, run_ids = mlflow_runs(client_env["MLFLOW_TRACKING_URI"], flow_runs)
        key = "rollout/reward_mean"
        runs_json = json.dumps(run_ids, separators=(",", ":"))
        exps_json = json.dumps([experiment], separators=(",", ":"))
        run_a = api_call("GET", f"{api}/flow_runs/{flow_runs['ui-check-a']}", timeout=10).json()
        run_async = api_call("GET", f"{api}/flow_runs/{flow_runs[ASYNC_RUN]}", timeout=10).json()
        # (file, URL, texts the rendered page must show); MLflow's URLs as its UI builds them
        pages = [
            (
                "prefect_flow_run.png",
                f"{prefect_ui}/runs/flow-run/{run_a['id']}",
                # its logs: the run's step lines (the last one too) beside Prefect's own
                [run_a["name"], "Completed", "rl-train", "Task Runs", "rl step 12/12"],
            ),
            (  # the async run's shape: its long-running task runs Running side by side
                "prefect_async_flow_run.png",
                f"{prefect_ui}/runs/flow-run/{run_async['id']}",
                [run_async["name"], "Completed", "rl-train", *LOOP_TASKS],
            ),
            (  # the RunConfig parameter as a form ("Custom run")
                "prefect_run_form.png",
                f"{prefect_ui}/deployments/deployment/{deployment}/run",
                ["Create Flow Run", "config", "Prompts Per Step", "architecture preset"],
            ),
            (
                "mlflow_compare_runs.png",
                f"{mlflow_ui}/#/compare-runs?runs={runs_json}&experiments={exps_json}",
                ["Comparing 2 Runs", *RUNS],
            ),
            (
                "mlflow_reward_chart.png",
                f"{mlflow_ui}/#/metric?runs={runs_json}"
                f"&metric={quote(json.dumps(key), safe='')}&experiments={exps_json}"
                f"&plot_metric_keys={quote(json.dumps([key]), safe='')}&plot_layout={{}}"
                "&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=true"
                "&deselected_curves=[]&last_linear_y_axis_range=[]",
                [key, *RUNS],
            ),
        ]
        OUT.mkdir(exist_ok=True)
        for filename, url, expect in pages:
            check_text(page_text(chromium, url), url, expect)
            path = OUT / filename
            screenshot(chromium, url, path)
            stats = check_png(path)
            print(f"{path.relative_to(REPO)}: {stats}\n  <- {url}")
        return 0
    except (CheckFailed, TimeoutError) as e:
        print(f"ui-check: error: {e}\nserve.py log tail:\n{tail(workdir / 'serve.log', 40)}")
        return 1
    finally:
        stop_serve(proc, seen)
        records = local_stack.load_records(cfg)
        for service in reversed(local_stack.SERVICES):
            if service in started and service in records:
                print(f"{service}: {stop_group(records[service])}")
                (cfg.pids / f"{service}.json").unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
