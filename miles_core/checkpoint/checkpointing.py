"""Checkpoints of an RL run: when a step is saved, what a checkpoint holds (store.py lists the
files: the trainer's weights and optimizer, `state.json`, the ledger of trained sample ids, the
async buffer), and how a run resumes from one — bit-identically to the uninterrupted run when
nothing that shapes the run changed."""

from __future__ import annotations

import logging
from pathlib import Path

from miles_core.checkpoint import rng_state
from miles_core.checkpoint.catch_up import record_what_the_dead_process_missed
from miles_core.checkpoint.ledger import LEDGER_FILE, TrainedLedger
from miles_core.checkpoint.registration import register_checkpoint
from miles_core.checkpoint.resume_checks import check_buffer_resumable, shape_changes
from miles_core.checkpoint.store import CheckpointStore, check_checkpoint_matches
from miles_core.engines.fleet import EngineFleet
from miles_core.engines.protocol import shared_generator
from miles_core.lora.adapter import ADAPTERS_DIR, set_base_model
from miles_core.precision.convert import save_quantized
from miles_core.rollout.buffer_state import BUFFER_FILE
from miles_core.weights.sync import WeightSync

log = logging.getLogger("miles")


class Checkpointing:
    """`start_step`: the step the run continues at (0, or a resumed step + 1);
    `last_saved_step`: the latest step saved by this process (or resumed from)."""

    def __init__(
        self,
        config,
        tracker,
        fleet: EngineFleet,
        weights: WeightSync,
        rollouts,  # rollout/sources.py: RolloutSource
        prompts,  # PromptSource
        tokenizer,
        architecture: dict,
        model_dir: Path | None = None,
    ):
        self.config = config
        self.model_dir = model_dir  # the run's starting model (a LoRA run's base)
        self.tracker = tracker
        self.fleet = fleet
        self.weights = weights
        self.rollouts = rollouts
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.architecture = architecture
        c = config.checkpoint
        self.store = CheckpointStore(c.root, config.name, c.storage_options)
        self.ledger = TrainedLedger()  # sample ids trained since the last checkpoint
        self.start_step = 0
        self.last_saved_step: int | None = None

    def is_save_step(self, step: int) -> bool:
        """Every checkpoint.interval steps, and the last step."""
        interval = self.config.checkpoint.interval
        last = step == self.config.train.num_steps - 1
        return last or (bool(interval) and (step + 1) % interval == 0)

    def save(self, step: int, metrics: dict[str, float] | None = None):
        """Checkpoint of `step`; returns (its URI, the registered model version or None, the
        sha256 of the weights its files hold)."""
        w, config = self.weights, self.config
        if self.tracker:
            # the steps before this one are in MLflow before the checkpoint exists (their
            # writes are batched, Tracker.flush_if_due); this step's own metrics travel in
            # the checkpoint ("step_metrics"), for a resume after a kill to log
            self.tracker.flush()
        checksum = self.fleet.checksum()
        saved_sha = w.trainer_checksum(checksum)  # of the files (differs for bf16 pushes)
        generator = shared_generator(self.fleet.engine)  # servers seed every request
        buffer = self.rollouts.snapshot()
        state = {
            "step": step,
            "policy_version": w.policy_version,
            "weights_sha256": checksum,
            "saved_weights_sha256": saved_sha,
            "init_model": config.model.path,
            # with a producer: after every admitted group (the buffer holds those not trained)
            "data": self.rollouts.data_state(buffer),
            "engine_rng": rng_state.encode_generator(generator) if generator is not None else None,
            "rng": rng_state.capture(),
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "architecture": self.architecture,
            "config": config.model_dump(mode="json"),
            "step_metrics": metrics or {},
        }
        files = {LEDGER_FILE: self.ledger.to_json()}
        if buffer is not None:
            files[BUFFER_FILE] = buffer

        lora = config.train.lora
        base = self.store.save_base(self.model_dir) if lora is not None else None

        def write(directory: Path) -> None:
            with w.exclusive():  # never beside a push to a replaced engine (SPMD calls)
                w.trainer.save(str(directory))
            self.tokenizer.save_pretrained(str(directory))
            if lora is not None:  # each adapter names the base it was trained on
                for name in lora.adapters:
                    set_base_model(directory / ADAPTERS_DIR / name, base)
            if w.plan is not None:  # rollout.precision: the weights as SGLang serves them too
                save_quantized(directory, w.plan)

        uri = self.store.save(step, write, state, files)
        self.last_saved_step = step
        self.ledger.saved(step)
        model_version = None
        if self.tracker:
            if config.tracking.register_policy:
                model_version = register_checkpoint(
                    self.tracker, config, step, w.policy_version, uri, saved_sha
                )
            self.tracker.set_tags({"miles.last_checkpoint": uri})
        return uri, model_version, saved_sha

    def resume(self, step: int) -> None:
        """Loads checkpoint `step`: weights, optimizer, LR schedule, data position, RNG states,
        version, the async buffer (handed to the producer on the first rollout), and pushes the
        weights; the run continues at step + 1. A checkpoint other than the latest becomes the
        latest (later ones belong to an abandoned lineage, overwritten as the run gets there)."""
        config, store, w = self.config, self.store, self.weights
        uri = store.uri(step)
        check_checkpoint_matches(self.architecture, uri, config.checkpoint.storage_options)
        state = store.read_state(step)
        buffer = store.read_json(step, BUFFER_FILE)
        check_buffer_resumable(buffer, config, step)
        changed = shape_changes(state.get("config"), config)
        if changed:
            log.warning(
                "resuming step %d with %s: training continues, but not bit-identically to an "
                "uninterrupted run",
                step,
                ", ".join(changed),
            )
        local = store.fetch(step)
        with w.exclusive():  # a replacement engine never gets half-loaded weights
            w.trainer.load(str(local))
        self.prompts.load_state(state["data"])
        generator = shared_generator(self.fleet.engine)
        if state.get("engine_rng") and generator is not None:
            rng_state.decode_generator(generator, state["engine_rng"])
        if state.get("rng"):
            rng_state.restore(state["rng"])
        self.rollouts.restore(buffer)  # async modes: the groups buffered at the checkpoint
        w.policy_version = w.engine_version = int(state["policy_version"])
        w.push(w.policy_version, config.rollout.pause_mode)
        self.start_step = self.last_saved_step = int(state["step"])
        self.start_step += 1
        self.ledger = TrainedLedger(previous_step=step)
        latest = store.latest_step()
        if latest != step:
            later = [s for s in store.steps() if s > step]
            log.warning(
                "resuming from step %d, not the latest (%s): checkpoints %s belong to the "
                "abandoned continuation and are overwritten as the run reaches them",
                step,
                latest,
                later,
            )
            store.mark_latest(step)
        record_what_the_dead_process_missed(self.tracker, config, step, state, uri)

    def close(self) -> None:
        self.store.close()
