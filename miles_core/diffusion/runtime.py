"""The image run's runtime: the phases the text runtime offers (run/runtime.py), over an image
engine, the image trainer and the same weight transports, checkpoint store and MLflow tracker,
so the same Prefect flow and loops (flows/rl_train.py, run/loops.py) run it.

    engine        ImageEngine in this process (embedded) or the image engine server (server)
    trainer       ImageTrainer (trainer.py), the run's image loss
    transport     weight_sync.transport: colocated, shared_memory or disk; with
                  weight_sync.check_equal the engine's checksum must equal the trainer's
    rollouts      each step's request (rollout.py); ahead of the trainer in one_step_off and
                  fully_async (producer.py)
    evaluation    the held-out scenes' accuracy with the ODE and an image grid (evaluation.py)
    checkpoints   CheckpointStore: the policy as an image model directory, the optimizer, the
                  run state; the starting model saved once beside them (the KL's reference)

Everything a step draws comes from seeds of (run seed, step): the prompts, the engine's noise,
the trained steps or DiffusionNFT's noise. A resumed sync run repeats an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from pathlib import Path

from miles_core.checkpoint.registration import register_checkpoint
from miles_core.checkpoint.store import CheckpointStore, fetch_model_dir
from miles_core.config import RunConfig
from miles_core.diffusion.evaluation import ImageEvaluation
from miles_core.diffusion.model import PRESETS, build_image_model, load_image_model
from miles_core.diffusion.producer import ImageRollouts
from miles_core.diffusion.rollout import ImageRollout, Sampling
from miles_core.diffusion.scenes import VOCABULARY, split_scenes
from miles_core.diffusion.trainer import ImageTrainer
from miles_core.eval.mode import EVAL_MODES
from miles_core.processes.auth import run_key
from miles_core.rollout.mode import MODES
from miles_core.run.runtime import new_workdir
from miles_core.run.tracking import Tracker
from miles_core.train.loss import LOSSES
from miles_core.weights import TRANSPORTS, TransportContext
from miles_core.weights.transport import PushStats

log = logging.getLogger("miles")


def step_seed(seed: int, step: int, salt: int) -> int:
    """A seed for what step `step` draws (`salt` tells the draws apart)."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**63)


def prepare_image_model(config: RunConfig, workdir: Path, tracker: Tracker | None = None) -> Path:
    """The image model directory the run starts from: a saved one (`diffusion.model` a path),
    or a new model of the preset, pretrained for `diffusion.pretrain_steps` on the training
    scenes (its loss logged as `pretrain/loss`)."""
    d = config.diffusion
    assert d is not None
    if d.model not in PRESETS:
        return fetch_model_dir(
            d.model, config.checkpoint.storage_options, workdir, marker="model_index.json"
        )
    out = workdir / "init_model"
    if not d.pretrain_steps:
        from miles_core.diffusion.model import save_image_model

        return save_image_model(build_image_model(d.model, config.model.seed), out)
    from miles_core.diffusion.pretrain import pretrain

    losses: list[float] = []

    def report(step: int, _model, loss: float) -> None:
        losses.append(loss)
        if tracker is not None and (step % 50 == 0 or step == d.pretrain_steps):
            tracker.log_metrics({"pretrain/loss": sum(losses) / len(losses)}, step)
            losses.clear()
        if step % 100 == 0 or step == d.pretrain_steps:
            log.info("pretraining: step %d of %d", step, d.pretrain_steps)

    return pretrain(
        d.model,
        out,
        d.pretrain_steps,
        batch_size=d.pretrain_batch_size,
        lr=d.pretrain_lr,
        seed=config.model.seed,
        callback=report,
    )


class ImageRuntime:
    """Everything one image run holds between steps; the phase methods of `RLRuntime`."""

    def __init__(self, config: RunConfig, model_dir: Path, tracker: Tracker | None):
        d = config.diffusion
        assert d is not None
        self.config, self.model_dir, self.tracker = config, Path(model_dir), tracker
        t = config.train
        self.loss = LOSSES.get(t.loss)
        needs = self.loss.needs(self.loss.config(t.loss_options or {}))
        self.trajectory = needs.trajectory
        self.sampling = Sampling(
            d.sampling_steps, d.noise_level if needs.trajectory else 0.0, d.guidance
        )
        self.train_scenes, self.held_scenes = split_scenes()
        self.policy_version = self.engine_version = 0
        self.start_step, self.last_saved_step = 0, None
        self.lock = threading.RLock()  # the trainer's weights: train, push, check, save, load
        with contextlib.ExitStack() as started:
            self.workdir = new_workdir()
            started.callback(shutil.rmtree, self.workdir, ignore_errors=True)
            model = load_image_model(model_dir)
            if model.vocabulary != VOCABULARY:
                raise ValueError(
                    f"{model_dir}: the model's vocabulary is not the scenes' (diffusion/scenes.py)"
                )
            if d.resolution is not None and d.resolution != model.image_size:
                raise ValueError(
                    f"diffusion.resolution {d.resolution}: the model makes "
                    f"{model.image_size}×{model.image_size} images"
                )
            context = TransportContext.of_run(config, self.workdir)
            transport = TRANSPORTS.get(config.weight_sync.transport)
            options = transport.Options.model_validate(config.weight_sync.transport_options or {})
            self.engine, self.process = self._start_engine(
                model, transport.engine_roots(context, options), started
            )
            self.trainer = ImageTrainer(
                model_dir,
                t.model_dump(),
                t.loss,
                t.loss_options,
                total_steps=t.num_steps * config.optimizer_steps_per_rollout,
                seed=config.seed,
                device=t.device,
            )
            started.callback(self.trainer.close)
            self.transport = transport.build(context, options)
            started.callback(self.transport.close)
            self.transport.connect([self.engine])
            self.store = CheckpointStore(
                config.checkpoint.root, config.name, config.checkpoint.storage_options
            )
            started.callback(self.store.close)
            mode = MODES.get(config.rollout.mode)
            self.rollouts = ImageRollouts(
                self._rollout_now,
                lambda: self.engine_version,
                ahead=mode.ahead,
                max_staleness=mode.staleness(config.rollout.mode_options).max_staleness,
                steps=t.num_steps,
            )
            started.callback(self.rollouts.close)
            self.evaluation = (
                ImageEvaluation(
                    config, self.engine, self.sampling, self.held_scenes, self.train_scenes, tracker
                )
                if EVAL_MODES.get(config.eval.mode).enabled
                else None
            )
            if self.evaluation is not None:
                started.callback(self.evaluation.close)
            if config.weight_sync.check_equal:
                self.check_weights_equal()
            if tracker is not None:
                origin = d.model if d.model not in PRESETS else f"preset {d.model}"
                tracker.set_tags({"miles.init_model": origin, "miles.modality": "image"})
            self._running = started.pop_all()

    def _start_engine(self, model, roots, started: contextlib.ExitStack):
        """(engine, its server process or None): in this process, or a server on 127.0.0.1
        that computes on the trainer's thread count (its GEMMs then reduce in the same order,
        so a recomputed log-prob is the engine's bit for bit)."""
        if self.config.rollout.engine == "embedded":
            from miles_core.diffusion.engine import ImageEngine

            return ImageEngine(model), None
        import torch

        from miles_core.diffusion.client import ImageEngineClient, ImageEngineProcess

        key = run_key()
        threads = self.config.train.threads or torch.get_num_threads()
        process = ImageEngineProcess(
            self.model_dir,
            args=["--threads", str(threads)],
            log_path=self.workdir / "image_engine.log",
            port_range=self.config.network.ports,
            api_key=key,
            weight_roots=list(roots),
        )
        process.start()
        started.callback(process.stop)
        client = ImageEngineClient(process.url, api_key=key)
        started.callback(client.close)
        return client, process

    # ------------------------------------------------------------------ phases
    def _rollout_now(self, step: int) -> ImageRollout:
        """Step `step`'s rollout on the engine, as it serves now."""
        from miles_core.diffusion.rollout import image_rollout, step_scenes

        c, d = self.config, self.config.diffusion
        scenes = step_scenes(self.train_scenes, c.rollout.prompts_per_step, c.data.seed, step)
        return image_rollout(
            self.engine,
            scenes,
            c.rollout.n_samples_per_prompt,
            self.sampling,
            step_seed(c.seed, step, 1),
            step,
            d.reward,
            c.train.advantage_estimator,
            c.train.advantage_estimator_options,
            self.trajectory,
            per_request=c.train.micro_batch_size // c.rollout.n_samples_per_prompt,
        )

    def rollout(self, step: int) -> ImageRollout:
        return self.rollouts.take(step)

    def train(self, result: ImageRollout) -> dict[str, float]:
        with self.lock:
            metrics = self.trainer.train_step(
                result,
                self.config.optimizer_steps_per_rollout,
                seed=step_seed(self.config.seed, result.step, 2),
            )
        # how many versions behind the trainer the engine was when it sampled this rollout
        metrics["rollout/staleness"] = float(self.policy_version - result.weight_version)
        return metrics

    @property
    def overlaps_pushes(self) -> bool:
        return False  # pushes run in line: the trainer's weights are pushed between steps

    def update_weights(self, snapshot=None) -> dict[str, float]:
        """Pushes the trainer's weights as the next policy version; with
        weight_sync.check_equal the engine's checksum must then equal the trainer's."""
        with self.lock:
            version = self.policy_version + 1
            stats: PushStats = self.transport.push(
                self.trainer, version, self.config.rollout.pause_mode
            )
            self.policy_version = self.engine_version = version
            if self.config.weight_sync.check_equal:
                self.check_weights_equal()
        self.rollouts.after_push()
        return stats.as_metrics() | {"train/policy_version": float(version)}

    def check_weights_equal(self) -> None:
        with self.lock:
            trainer, engine = self.trainer.weights_checksum(), self.engine.weights_checksum()
        if trainer != engine:
            raise RuntimeError(
                f"after the push of version {self.policy_version} the engine's weights differ "
                f"from the trainer's (sha256 {engine[:12]} ≠ {trainer[:12]})"
            )

    def engine_checksum(self) -> str:
        return self.engine.weights_checksum()

    # ------------------------------------------------------------------ checkpoints
    def is_save_step(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return step == self.config.train.num_steps - 1 or bool(
            interval and (step + 1) % interval == 0
        )

    def save(self, step: int, metrics: dict[str, float] | None = None) -> str:
        """Checkpoint of `step`: the policy (an image model directory), the optimizer, the
        run state; the starting model once, beside the checkpoints."""
        if self.tracker is not None:
            self.tracker.flush()
        base = self.store.save_base(self.model_dir, marker="model_index.json")
        with self.lock:
            checksum = self.trainer.weights_checksum()
            state = {
                "step": step,
                "policy_version": self.policy_version,
                "weights_sha256": checksum,
                "init_model": base,
                "mlflow_run_id": self.tracker.run_id if self.tracker else None,
                "modality": "image",
                "config": self.config.model_dump(mode="json"),
                "step_metrics": metrics or {},
            }
            uri = self.store.save(step, self.trainer.save, state)
        self.last_saved_step = step
        if self.tracker is not None:
            if self.config.tracking.register_policy:
                register_checkpoint(
                    self.tracker, self.config, step, self.policy_version, uri, checksum
                )
            self.tracker.set_tags({"miles.last_checkpoint": uri})
        return uri

    def resume(self, step: int) -> None:
        """Continues checkpoint `step`: weights, optimizer, LR schedule and version are loaded
        and pushed; the run goes on at step + 1."""
        state = self.store.read_state(step)
        if state.get("modality") != "image":
            raise ValueError(
                f"checkpoint step {step} of run {self.config.name!r} is not an image run's"
            )
        local = self.store.fetch(step)
        with self.lock:
            self.trainer.load(local)
            version = int(state["policy_version"])
            self.transport.push(self.trainer, version, self.config.rollout.pause_mode)
            self.policy_version = self.engine_version = version
            if self.config.weight_sync.check_equal:
                self.check_weights_equal()
        self.start_step = step + 1
        self.last_saved_step = step
        self.rollouts.start_at(self.start_step)

    # ------------------------------------------------------------------ evaluation
    def eval_due(self, version: int) -> bool:
        return self.evaluation is not None and self.evaluation.due(version)

    def submit_evaluation(self, version: int) -> None:
        assert self.evaluation is not None
        self.evaluation.submit(version)

    def finished_evaluations(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        return [] if self.evaluation is None else self.evaluation.finished()

    @property
    def producer(self):
        return self.rollouts.producer

    def close(self) -> None:
        self._running.close()
