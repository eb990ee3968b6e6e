"""`miles` command line: `miles train`, `miles sft`, `miles engine serve`.

    miles train --config examples/say_a.yaml --set train.lr=5e-4 --set train.num_steps=20
    miles train --config examples/say_a.yaml --resume
    miles train --config examples/say_a.yaml --resume --resume-step 19
    miles sft --config examples/reverse_sft_rl.yaml
    miles engine serve --model checkpoints/say-a/step_000039 --port 30000
    miles sessions serve --engine-url http://127.0.0.1:30000 --family tiny --port 30100
    miles model init --family qwen3 --preset tiny models/qwen3-tiny   (--tokenizer DIR|PACKAGE)
    miles tito verify --family qwen3   (or --family package.module:Class [--model DIR])
    miles evaluate --model say-a [--version 3 | --alias best-eval] [--force]
    miles eval serve --port 30200      (the reference service of eval.mode: external)
    miles run unlock say-a --checkpoint-root checkpoints   (the lock of a run that is gone)
    miles prefect status | stop   (the local Prefect server runs share when no API is set)

With `train.world_size: N > 1` the command re-launches itself under torchrun; rank 0 runs the
flow, ranks 1..N-1 replay the trainer's calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from miles_core.config import RunConfig, load_config
from miles_core.run.timeline import mark


def _overrides_argument(
    parser: argparse.ArgumentParser, help_text: str = "override a dotted config key"
) -> None:
    """`--set KEY=VALUE`, repeatable: the config overrides of a command that reads a config."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="RL post-training on Prefect + MLflow")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "RL training run (rl-train flow)"),
        ("sft", "supervised fine-tuning run (sft flow)"),
    ):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--config", required=False, help="YAML config file")
        _overrides_argument(c)
        c.add_argument(
            "--no-progress", action="store_true", help="log lines instead of a progress bar"
        )
        if name == "train":
            c.add_argument(
                "--resume",
                action="store_true",
                help="continue the run from its latest checkpoint: the loop starts at the saved "
                "step + 1, train.num_steps stays the total; model, optimizer, LR schedule, RNG, "
                "data position, async rollout buffer and MLflow run continue",
            )
            c.add_argument(
                "--resume-step",
                type=int,
                default=None,
                metavar="N",
                help="with --resume (implied): continue from the checkpoint of step N instead of "
                "the latest (refused if there is none); it becomes the latest, later "
                "checkpoints are overwritten as the run reaches them",
            )
    conv = sub.add_parser(
        "convert",
        help="write an HF checkpoint in a low-precision format SGLang loads (precision/convert.py)",
    )
    conv.add_argument("src", help="the float checkpoint (an HF model directory)")
    conv.add_argument("dst", help="the new directory (must not exist)")
    conv.add_argument(
        "--to",
        default=None,
        help="format: fp8 | fp8_block | mxfp8 | nvfp4 | int4 (default: the config's "
        "rollout.precision)",
    )
    conv.add_argument(
        "--config", default=None, help="a run config: its rollout.precision and precision.keep_bf16"
    )
    _overrides_argument(
        conv,
        "override a dotted config key (rollout.precision_options.group_size=32, "
        "precision.keep_bf16.first_layers=1, …)",
    )
    plan = sub.add_parser(
        "plan", help="lay a run config out on a GPU fleet without starting it (plan/plan.py)"
    )
    plan.add_argument("--config", required=True, help="YAML config file")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs of the fleet, in all")
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: rollout.max_new_tokens)",
    )
    _overrides_argument(plan)
    engine = sub.add_parser("engine", help="rollout engine commands")
    engine.add_argument("action", choices=["serve"], help="serve: the HTTP engine server")
    engine.add_argument("rest", nargs=argparse.REMAINDER, help="--model DIR --port P ...")
    sessions = sub.add_parser("sessions", help="agent session server commands")
    sessions.add_argument("action", choices=["serve"], help="serve: the OpenAI-compatible server")
    sessions.add_argument("rest", nargs=argparse.REMAINDER, help="--engine-url URL --family F ...")
    ev = sub.add_parser("evaluate", help="score a registered policy version (evaluate-policy flow)")
    ev.add_argument("--model", required=True, help="registered model name (the run's name)")
    ev.add_argument("--version", default=None, help="model version (default: the alias's)")
    ev.add_argument("--alias", default="newest", help="alias used without --version")
    ev.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI")
    ev.add_argument(
        "--prompts", type=int, default=None, help="fixed evaluation prompts (default: the run's)"
    )
    ev.add_argument("--force", action="store_true", help="score a version scored already")
    service = sub.add_parser("eval", help="evaluation service commands")
    service.add_argument("action", choices=["serve"], help="serve: the external-mode service")
    service.add_argument("rest", nargs=argparse.REMAINDER, help="--port P --host H")
    pf = sub.add_parser("prefect", help="the local Prefect server runs share (no PREFECT_API_URL)")
    pf.add_argument("action", choices=["status", "stop"], help="status: its address; stop: now")
    run = sub.add_parser("run", help="run-name lock commands")
    run.add_argument("action", choices=["unlock"], help="unlock: clear the lock of a dead run")
    run.add_argument("name", help="the run name (config `name`)")
    run.add_argument(
        "--checkpoint-root",
        default=os.environ.get("MILES_CHECKPOINT_ROOT", "checkpoints"),
        help="the run's checkpoint.root (default: $MILES_CHECKPOINT_ROOT, else ./checkpoints)",
    )
    run.add_argument(
        "--storage-options", default="{}", metavar="JSON", help="checkpoint.storage_options"
    )
    model = sub.add_parser("model", help="model folder commands")
    model.add_argument(
        "action", choices=["init"], help="init: a random-init model on a tokenizer, for a family"
    )
    model.add_argument("out", help="the new model folder (must not exist, or be empty)")
    model.add_argument(
        "--family", required=True, help="TITO family: a name or package.module:Class"
    )
    model.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|PACKAGE",
        help="a Hugging Face tokenizer folder, or an installed package that ships one "
        "(default: the family's own tokenizer)",
    )
    model.add_argument("--preset", default="tiny", help="architecture preset (models/presets.py)")
    model.add_argument("--seed", type=int, default=0, help="the random init's seed")
    model.add_argument(
        "--context", type=int, default=None, help="max_position_embeddings (default: the preset's)"
    )
    tito = sub.add_parser("tito", help="token-in-token-out tokenizer commands")
    tito.add_argument("action", choices=["verify"], help="verify: check a family's renders")
    from miles_core.tito import FAMILIES

    tito.add_argument(
        "--family",
        required=True,
        help=f"TITO family: {', '.join(FAMILIES.names())}, or 'package.module:Class'",
    )
    tito.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a model directory: also compare every turn with the chat template it ships",
    )
    tito.add_argument("--conversations", type=int, default=20, help="per conversation kind")
    tito.add_argument("--turns", type=int, default=8, help="assistant turns per conversation")
    tito.add_argument("--seed", type=int, default=0)
    return p


def _convert(args) -> int:
    from miles_core.precision.convert import convert_checkpoint
    from miles_core.precision.plan import QuantPlan

    overrides = list(args.overrides) + ([f"rollout.precision={args.to}"] if args.to else [])
    try:
        config = load_config(args.config, overrides)
        src_config = json.loads((Path(args.src) / "config.json").read_text())
        plan = QuantPlan.of(config, int(src_config["num_hidden_layers"]))
        if plan is None:
            return _fail("convert: give a format with --to (or rollout.precision in --config)")
        summary = convert_checkpoint(args.src, args.dst, plan)
    except ValidationError as e:
        return _fail(invalid_config(e))
    except (ValueError, OSError, KeyError) as e:
        return _fail(str(e))
    print(json.dumps(summary), flush=True)
    return 0


def invalid_config(e: ValidationError) -> str:
    """A config's validation errors, one line each: the setting, then what is wrong."""
    lines = []
    for err in e.errors():
        where = ".".join(str(part) for part in err["loc"]) or "config"
        lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "invalid config: " + "\n".join(lines)


def _fail(message: str) -> int:
    print(f"miles: error: {message}", file=sys.stderr)
    return 2


def torchrun_command(
    world_size: int, port_range=None, target: tuple[str, ...] = ("-m", "flows.cli")
) -> list[str]:
    """torchrun for this command on one host. Without a port range: `--standalone` (its
    rendezvous store binds port 0 itself, no race). With `network.port_range`: the static
    rendezvous on a port of the range (`--master-port`; its store is the one the ranks use, so
    no other port opens); torchrun binds it, so the port is probed free just before."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    torchrun = beside if os.path.exists(beside) else shutil.which("torchrun") or "torchrun"
    if port_range is None:
        rendezvous = ["--standalone"]
    else:
        from miles_core.processes.ports import free_port

        port = free_port("127.0.0.1", port_range)  # NoFreePort: a clear error, nothing started
        rendezvous = [
            "--nnodes=1",
            "--node-rank=0",
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
    return [torchrun, *rendezvous, f"--nproc_per_node={world_size}", *target]


def _relaunch_under_torchrun(world_size: int, port_range=None) -> int:
    try:
        cmd = torchrun_command(world_size, port_range)
    except OSError as e:
        return _fail(f"network.port_range: {e}")
    return subprocess.call([*cmd, *sys.argv[1:]])


def _plan(args) -> int:
    from miles_core.plan.plan import PlanError, make_plan
    from miles_core.plan.report import render

    if args.gpus < 1 or (args.seq_len is not None and args.seq_len < 1):
        return _fail("--gpus and --seq-len must be positive")
    try:
        config = load_config(args.config, args.overrides)
        plan = make_plan(config, args.gpus, args.seq_len)
    except (PlanError, ValueError, OSError) as e:
        return _fail(str(e))
    print(render(plan, config))
    return 0


def main(argv: list[str] | None = None) -> int:
    mark("main")
    args = _parser().parse_args(argv)
    if args.command == "engine":
        from miles_core.engines.cpu import server

        server.main(args.rest)
        return 0
    if args.command == "sessions":
        from miles_core.sessions import server as session_server

        session_server.main(args.rest)
        return 0
    if args.command == "eval":
        from miles_core.eval import service as eval_service

        eval_service.main(args.rest)
        return 0
    if args.command == "evaluate":
        with prefect_api() as api_ready:
            from flows.evaluate import evaluate

            api_ready()
            try:
                result = evaluate(
                    args.model,
                    args.version,
                    args.alias,
                    args.tracking_uri,
                    args.prompts,
                    skip_evaluated=not args.force,
                )
            except LookupError as e:
                return _fail(str(e))
        print(json.dumps(result), flush=True)
        return 0
    if args.command == "tito":
        from flows.tito_verify import run_verify

        return run_verify(args.family, args.conversations, args.turns, args.seed, args.model)
    if args.command == "model":
        from miles_core.models.init import init_model

        try:
            summary = init_model(
                args.family, args.tokenizer, args.preset, args.out, args.seed, args.context
            )
        except (ValueError, OSError) as e:
            return _fail(str(e))
        print(json.dumps(summary), flush=True)
        return 0
    if args.command == "convert":
        return _convert(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "run":
        return _unlock(args.name, args.checkpoint_root, args.storage_options)
    if args.command == "prefect":
        from flows.prefect_server import local_status, stop_local

        print(local_status() if args.action == "status" else stop_local())
        return 0
    try:
        config = load_config(args.config, args.overrides)
    except ValidationError as e:
        return _fail(invalid_config(e))
    except (ValueError, OSError) as e:
        return _fail(str(e))

    from miles_core.cluster.backend import CLUSTERS

    # the ranks this command's processes hold: the cluster backend may place them elsewhere
    world = (
        config.train.world_size if CLUSTERS.get(config.cluster.backend).ranks_under_torchrun else 1
    )
    if world > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _relaunch_under_torchrun(world, config.network.ports)
    if int(os.environ.get("RANK", "0")) > 0:
        from miles_core.train import distributed

        distributed.init_distributed(config.train.device)  # gloo on CPU, nccl on CUDA
        distributed.follow()
        return 0
    # the Prefect API first: a server started now boots while the run imports torch and checks
    # its inputs; the run's result is printed once its log lines have reached it
    with prefect_api() as api_ready:
        code, result = _checked_run(args, config, world, api_ready)
    if result is not None:
        print(json.dumps(result), flush=True)
        mark("summary")
    return code


def _checked_run(args, config: RunConfig, world: int, api_ready) -> tuple[int, dict | None]:
    from miles_core.checkpoint.run_lock import RunClaim
    from miles_core.run.preflight import preflight, run_names

    try:
        preflight(
            config,
            resume=getattr(args, "resume", False),
            resume_step=getattr(args, "resume_step", None),
        )
        # the run's names, claimed before Prefect or MLflow start: of two runs of one name
        # started together, one gets here (checkpoint/run_lock.py); released when the run ends
        claim = RunClaim(
            config.checkpoint.root, run_names(config), config.checkpoint.storage_options
        )
        mark("preflight")
    except (ValueError, OSError) as e:
        _shutdown(world, config.train.device)
        return _fail(str(e)), None
    with claim:
        return 0, _run(args, config, world, api_ready)


def _unlock(name: str, root: str, storage_options: str) -> int:
    """`miles run unlock NAME`: removes the lock a run that is gone left (refused while its
    owner runs on this host)."""
    from miles_core.checkpoint.run_lock import unlock

    try:
        options = json.loads(storage_options)
        if not isinstance(options, dict):
            raise ValueError(f"--storage-options must be a JSON object, got {storage_options!r}")
        owner = unlock(root, name, options)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    print(f"run {name!r}: " + (f"removed the lock of {owner.describe()}" if owner else "no lock"))
    return 0


def _shutdown(world: int, device: str = "cpu") -> None:
    """Releases the follower ranks (which wait for rank 0 even if it failed before training)."""
    from miles_core.train import distributed

    if world > 1:
        distributed.init_distributed(device)
    distributed.shutdown()


def _run(args, config: RunConfig, world: int, api_ready: Callable[[], None]) -> dict:
    from miles_core.run.preflight import checked_inputs
    from miles_core.run.progress import RichReporter, set_reporter

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpx2", "httpcore", "openai", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.no_progress and sys.stderr.isatty():
        set_reporter(RichReporter())
    try:
        if args.command == "train":
            from flows.rl_train import rl_train

            resume = args.resume or args.resume_step is not None
            api_ready()
            with checked_inputs(config, resume, args.resume_step):  # by `preflight` above
                return rl_train(config, resume=resume, resume_step=args.resume_step)
        from flows.sft import sft

        api_ready()
        return {"policy": sft(config)}
    finally:
        _shutdown(world, config.train.device)


@contextlib.contextmanager
def prefect_api() -> Iterator[Callable[[], None]]:
    """The Prefect API of a command that runs flows (flows/prefect_server.py): the configured
    one, else this user's kept local server, started now if none runs; yields the call that
    waits until it answers (the command checks its inputs and imports its flow meanwhile). On
    the way out, every log line and event of the run is sent while the API still answers."""
    from flows.prefect_server import drain_to_api, use_local_api

    api = use_local_api()
    used = False

    def ready() -> None:
        nonlocal used
        used = True
        if api is not None:
            api.wait_ready()
            print(f"Prefect UI: {api.ui_url}", file=sys.stderr, flush=True)
        mark("api_ready")

    try:
        yield ready
    finally:
        try:
            drain_to_api()
        finally:
            if api is not None:  # refused before its first flow: a server it started stops
                api.release(unused=not used)


def run() -> NoReturn:
    """The `miles` command: `main`, then the exit of a finished command without the
    interpreter's teardown of torch and the other extensions (processes/fast_exit.py: atexit handlers
    and the streams' flush still run; the run's log lines and events were sent before)."""
    from miles_core.processes.fast_exit import exit_after

    exit_after(lambda: sys.exit(main()))


if __name__ == "__main__":
    run()
