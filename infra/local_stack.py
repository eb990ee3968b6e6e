"""`local-stack up|down|status`: Prefect server (API + UI), MLflow tracking server and an
S3-compatible object store (moto) on 127.0.0.1, each a detached process recorded by PID.

    infra/local-stack up            # starts what is not running, prints the env to export
    source .local-stack/env         # PREFECT_API_URL, MLFLOW_TRACKING_URI, AWS_* for s3://
    infra/local-stack status        # each service up/down with its URL (exit 1 if any is down)
    infra/local-stack down          # SIGTERM each process group, SIGKILL after 20 s
    infra/local-stack down --purge  # also deletes the state dir (databases, logs)

State dir (default `<repo>/.local-stack`, or `$MILES_STACK_DIR` / `--state-dir`):
`pids/<service>.json` (PID, start time, port, URL, log), `logs/<service>.log`, `prefect/`
(the Prefect server's PREFECT_HOME and SQLite DB), `mlflow.db`, `env`.
Ports: 4200 (Prefect), 5000 (MLflow), 5555 (S3), or `$MILES_STACK_{PREFECT,MLFLOW,S3}_PORT` /
`--prefect-port` etc. The object store keeps its objects in memory: `down` loses them (the
Prefect and MLflow databases stay), so artifacts and checkpoints of earlier sessions are gone.
MLflow stores run artifacts in `s3://<bucket>/mlflow` (proxied by the server: clients upload
through it); runs should write checkpoints under `s3://<bucket>/checkpoints`, because a tracking
server refuses to register model versions whose source is a local path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infra.processes import (
    ProcessRecord,
    ServiceError,
    healthy,
    port_free,
    record_alive,
    spawn,
    stop_group,
    wait_healthy,
)

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
S3_KEY = S3_SECRET = "testing"  # moto accepts any credentials
S3_REGION = "us-east-1"
SERVICES = ("s3", "prefect", "mlflow")  # start order; stopped in reverse
TELEMETRY_OFF = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


@dataclass(frozen=True)
class StackConfig:
    state_dir: Path
    prefect_port: int = 4200
    mlflow_port: int = 5000
    s3_port: int = 5555
    bucket: str = "miles"
    timeout_s: float = 180.0

    @classmethod
    def from_env(cls, **overrides) -> StackConfig:
        env = os.environ
        values = {
            "state_dir": Path(env.get("MILES_STACK_DIR", REPO / ".local-stack")),
            "prefect_port": int(env.get("MILES_STACK_PREFECT_PORT", 4200)),
            "mlflow_port": int(env.get("MILES_STACK_MLFLOW_PORT", 5000)),
            "s3_port": int(env.get("MILES_STACK_S3_PORT", 5555)),
            "bucket": env.get("MILES_STACK_BUCKET", "miles"),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["state_dir"] = Path(values["state_dir"]).resolve()
        return cls(**values)

    @property
    def pids(self) -> Path:
        return self.state_dir / "pids"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    def port(self, service: str) -> int:
        return {"s3": self.s3_port, "prefect": self.prefect_port, "mlflow": self.mlflow_port}[
            service
        ]


def urls(cfg: StackConfig) -> dict[str, str]:
    return {s: f"http://{HOST}:{cfg.port(s)}" for s in SERVICES}


def client_env(cfg: StackConfig) -> dict[str, str]:
    """What a user (or a served flow run) exports to talk to the stack."""
    u = urls(cfg)
    return {
        "PREFECT_API_URL": f"{u['prefect']}/api",
        "MLFLOW_TRACKING_URI": u["mlflow"],
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": S3_REGION,
        "AWS_ENDPOINT_URL": u["s3"],  # boto3/botocore ≥ 1.31 and s3fs (through aiobotocore)
        "FSSPEC_S3_ENDPOINT_URL": u["s3"],  # fsspec's own config for s3:// URLs
        "MLFLOW_S3_ENDPOINT_URL": u["s3"],
        "MILES_CHECKPOINT_ROOT": f"s3://{cfg.bucket}/checkpoints",
        **TELEMETRY_OFF,
    }


def _bin(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise ServiceError(
            f"`{name}` not found; install the extras: pip install -e '.[server,test]'"
        )
    return found


def _command(cfg: StackConfig, service: str) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, health URL) of one service."""
    port, base = cfg.port(service), urls(cfg)[service]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
    env.update(TELEMETRY_OFF)
    if service == "s3":
        return [_bin("moto_server"), "-H", HOST, "-p", str(port)], env, f"{base}/moto-api/"
    if service == "prefect":
        env["PREFECT_HOME"] = str(cfg.state_dir / "prefect")
        # the UI's API address comes from settings, not from --port: without these the UI on
        # any port but 4200 asks http://127.0.0.1:4200/api and shows "Can't connect to Server API"
        env["PREFECT_SERVER_API_HOST"] = HOST
        env["PREFECT_SERVER_API_PORT"] = str(port)
        env["PREFECT_UI_API_URL"] = f"{base}/api"
        argv = [_bin("prefect"), "server", "start", "--host", HOST, "--port", str(port)]
        return argv, env, f"{base}/api/health"
    env.update(
        {
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # 2 processes instead of 10
            "MLFLOW_S3_ENDPOINT_URL": urls(cfg)["s3"],
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": S3_REGION,
        }
    )
    argv = [
        _bin("mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{cfg.state_dir / 'mlflow.db'}",
        "--artifacts-destination",
        f"s3://{cfg.bucket}/mlflow",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    return argv, env, f"{base}/health"


def load_records(cfg: StackConfig) -> dict[str, ProcessRecord]:
    if not cfg.pids.is_dir():
        return {}
    return {p.stem: ProcessRecord.load(p) for p in sorted(cfg.pids.glob("*.json"))}


def recorded_config(cfg: StackConfig) -> StackConfig:
    """The ports a running stack was started with win over defaults (status/down need no flags)."""
    records = load_records(cfg)
    ports = {f"{s}_port": records[s].port for s in SERVICES if s in records}
    saved = cfg.state_dir / "stack.json"
    bucket = json.loads(saved.read_text())["bucket"] if saved.exists() else cfg.bucket
    return StackConfig(cfg.state_dir, **{**_ports(cfg), **ports}, bucket=bucket)


def _ports(cfg: StackConfig) -> dict[str, int]:
    return {f"{s}_port": cfg.port(s) for s in SERVICES}


def create_bucket(cfg: StackConfig) -> None:
    import fsspec

    fs = fsspec.filesystem(
        "s3",
        endpoint_url=urls(cfg)["s3"],
        key=S3_KEY,
        secret=S3_SECRET,
        skip_instance_cache=True,
    )  # no region in client_kwargs: it makes mkdir send an invalid LocationConstraint
    if not fs.exists(cfg.bucket):
        fs.mkdir(cfg.bucket)


def write_env(cfg: StackConfig) -> Path:
    lines = [f"export {k}={v}" for k, v in client_env(cfg).items()]
    cfg.env_file.write_text("\n".join(lines) + "\n")
    return cfg.env_file


def up(cfg: StackConfig, log=print) -> dict[str, ProcessRecord]:
    """Start every service that is not already running (healthy and recorded); idempotent."""
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    records = load_records(cfg)
    running: dict[str, ProcessRecord] = {}
    for name, record in records.items():
        if record_alive(record):
            running[name] = record
        else:
            (cfg.pids / f"{name}.json").unlink()  # a stale record (crashed, rebooted)
    cfg = StackConfig(
        cfg.state_dir,
        **{**_ports(cfg), **{f"{n}_port": r.port for n, r in running.items()}},
        bucket=cfg.bucket,
        timeout_s=cfg.timeout_s,
    )
    (cfg.state_dir / "stack.json").write_text(json.dumps({"bucket": cfg.bucket}))
    t0 = time.monotonic()
    for group in (("s3",), ("prefect", "mlflow")):  # the store first: MLflow writes to it
        started = []
        for service in group:
            if service in running:
                log(f"{service}: already running (pid {running[service].pid})")
                continue
            if not port_free(HOST, cfg.port(service)):
                raise ServiceError(
                    f"{service}: port {cfg.port(service)} on {HOST} is in use by a process this "
                    f"stack did not start; choose another with --{service}-port or "
                    f"MILES_STACK_{service.upper()}_PORT"
                )
            argv, env, health = _command(cfg, service)
            record = spawn(
                service,
                argv,
                env,
                cfg.port(service),
                urls(cfg)[service],
                health,
                cfg.state_dir / "logs" / f"{service}.log",
                cwd=cfg.state_dir,
            )
            record.save(cfg.pids)
            started.append(record)
        try:
            took = wait_healthy(started, cfg.timeout_s)
        except ServiceError:
            for record in started:
                stop_group(record)
                (cfg.pids / f"{record.name}.json").unlink(missing_ok=True)
            raise
        for name, seconds in took.items():
            log(f"{name}: started in {seconds:.1f} s at {urls(cfg)[name]}")
        if "s3" in group:
            create_bucket(cfg)
    log(f"stack up in {time.monotonic() - t0:.1f} s; env in {write_env(cfg)}")
    return load_records(cfg)


def down(cfg: StackConfig, purge: bool = False, log=print) -> None:
    """Stop every recorded service (whole process group) and remove its record."""
    records = load_records(cfg)
    for name in reversed(SERVICES):
        if name in records:
            log(f"{name}: {stop_group(records[name])} (pid {records[name].pid})")
            (cfg.pids / f"{name}.json").unlink(missing_ok=True)
    if not records:
        log("nothing running")
    if purge and cfg.state_dir.exists():
        shutil.rmtree(cfg.state_dir)
        log(f"removed {cfg.state_dir}")


def status(cfg: StackConfig) -> dict[str, dict]:
    """Each service: up (recorded, alive, healthy) / unhealthy (alive, not answering) / down."""
    records = load_records(cfg)
    cfg = recorded_config(cfg)
    out = {}
    for name in SERVICES:
        record = records.get(name)
        if record is None or not record_alive(record):
            state, pid = "down", None
        else:
            state = "up" if healthy(record.health_url) else "unhealthy"
            pid = record.pid
        out[name] = {
            "state": state,
            "pid": pid,
            "url": urls(cfg)[name],
            "log": str(cfg.state_dir / "logs" / f"{name}.log"),
        }
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="local-stack", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--state-dir", help="default $MILES_STACK_DIR or <repo>/.local-stack")
    p.add_argument("--prefect-port", type=int)
    p.add_argument("--mlflow-port", type=int)
    p.add_argument("--s3-port", type=int)
    p.add_argument("--bucket")
    p.add_argument("--timeout", type=float, dest="timeout_s", help="seconds per health wait")
    p.add_argument("--purge", action="store_true", help="down: also delete the state dir")
    p.add_argument("--json", action="store_true", help="status: machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = StackConfig.from_env(
        state_dir=args.state_dir,
        prefect_port=args.prefect_port,
        mlflow_port=args.mlflow_port,
        s3_port=args.s3_port,
        bucket=args.bucket,
        timeout_s=args.timeout_s,
    )
    try:
        if args.action == "up":
            up(cfg)
            print(f"\n# export these (or: source {cfg.env_file})")
            print(cfg.env_file.read_text(), end="")
            return 0
        if args.action == "down":
            down(cfg, purge=args.purge)
            return 0
    except ServiceError as e:
        print(f"local-stack: error: {e}", file=sys.stderr)
        return 1
    report = status(cfg)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, s in report.items():
            pid = f"pid {s['pid']}" if s["pid"] else ""
            print(f"{name:8} {s['state']:10} {s['url']:28} {pid}")
    return 0 if all(s["state"] == "up" for s in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
