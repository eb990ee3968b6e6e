"""Serve the training deployment and the scheduled evaluation deployment from this process.

    make stack-up && source .local-stack/env
    python deployments/serve.py                        # say-a defaults, evaluation every 300 s
    python deployments/serve.py --model say-a --cron '*/10 * * * *'

Registers two deployments with the Prefect server at $PREFECT_API_URL and runs their flow runs
as child processes of this one (a Prefect runner; no work pool or worker needed):

- `rl-train/train`: `flows/rl_train.py: rl_train`. Its `config` parameter is a `RunConfig`
  (pydantic), so the Prefect UI's "Run ▸ Custom run" shows it as a form, prefilled from
  `--config` (default `examples/say_a.yaml`) with `checkpoint.root` = `--checkpoint-root` (default
  $MILES_CHECKPOINT_ROOT, the stack's `s3://miles/checkpoints`: an MLflow tracking server only
  registers model versions whose checkpoint is not a local path) and `tracking.tracking_uri`.
  A run started with a `config` replaces the whole default, so give every field you need.
- `evaluate-policy/scheduled`: `flows/evaluate.py: evaluate` on an interval (`--interval`, s) or a
  cron schedule (`--cron`), scoring the `newest` registered version of `--model` and skipping
  versions already scored; at most one runs at a time (a run due while one is running is
  cancelled).

Flow runs inherit this process's environment (AWS_* / FSSPEC_S3_ENDPOINT_URL for s3://,
MLFLOW_TRACKING_URI). SIGTERM or Ctrl-C stops serving and pauses the evaluation schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.types.entrypoint import EntrypointType

from miles_core.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[1]
TRAIN_DEPLOYMENT = "train"  # rl-train/train
EVAL_DEPLOYMENT = "scheduled"  # evaluate-policy/scheduled
DEFAULT_CONFIG = REPO / "examples" / "say_a.yaml"


def training_defaults(
    config_path: str | Path | None, checkpoint_root: str | None, tracking_uri: str | None
) -> RunConfig:
    """The config the training deployment's form starts from."""
    overrides = []
    if checkpoint_root:
        overrides += [f"checkpoint.root={checkpoint_root}", "checkpoint.interval=10"]
    if tracking_uri:
        overrides.append(f"tracking.tracking_uri={tracking_uri}")
    return load_config(config_path, overrides)


def build_deployments(
    model: str | None = None,
    interval_s: float | None = 300.0,
    cron: str | None = None,
    config_path: str | Path | None = DEFAULT_CONFIG,
    checkpoint_root: str | None = None,
    tracking_uri: str | None = None,
    eval_prompts: int | None = None,
) -> list[RunnerDeployment]:
    """The training deployment and the scheduled evaluation deployment (not yet registered)."""
    from flows.evaluate import evaluate
    from flows.rl_train import rl_train

    defaults = training_defaults(config_path, checkpoint_root, tracking_uri)
    train = rl_train.to_deployment(
        name=TRAIN_DEPLOYMENT,
        parameters={"config": defaults.model_dump(mode="json"), "resume": False},
        description="RL training run; the config parameter is the whole RunConfig.",
        tags=["miles", "train"],
        entrypoint_type=EntrypointType.MODULE_PATH,  # importable from any working directory
    )
    schedule = {"cron": cron} if cron else {"interval": interval_s}
    scheduled_eval = evaluate.to_deployment(
        name=EVAL_DEPLOYMENT,
        parameters={
            "model": model or defaults.name,
            "alias": "newest",
            "tracking_uri": tracking_uri,
            "prompts": eval_prompts,
            "skip_evaluated": True,
        },
        description="Scores the newest registered policy version; a nested run of its training run.",
        tags=["miles", "eval"],
        concurrency_limit=ConcurrencyLimitConfig(
            limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
        ),
        entrypoint_type=EntrypointType.MODULE_PATH,
        **schedule,
    )
    return [train, scheduled_eval]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="registered model to evaluate (default: the config's name)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--interval", type=float, default=300.0, help="evaluation every N seconds")
    when.add_argument("--cron", help="evaluation on a cron schedule instead")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML: training form defaults")
    p.add_argument("--checkpoint-root", default=os.environ.get("MILES_CHECKPOINT_ROOT"))
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    p.add_argument("--eval-prompts", type=int, default=None, help="default: the run's eval.prompts")
    p.add_argument("--limit", type=int, default=None, help="most flow runs at once")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "serve.py: error: PREFECT_API_URL is not set; start the stack (make stack-up) and "
            "`source .local-stack/env` (deployments need a Prefect server)",
            file=sys.stderr,
        )
        return 2
    deployments = build_deployments(
        model=args.model,
        interval_s=args.interval,
        cron=args.cron,
        config_path=args.config,
        checkpoint_root=args.checkpoint_root,
        tracking_uri=args.tracking_uri,
        eval_prompts=args.eval_prompts,
    )
    serve(*deployments, limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
