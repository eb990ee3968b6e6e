"""The RL runtime: one run's components, composed, and the phase methods the flow's tasks call.

    EngineFleet     engines/fleet.py            the engine (`rollout.engine`), its server, supervision
    trainer         training.py         the backend (`train.backend`) and the RL train phase
    WeightSync      weights/sync.py      the transport, policy versions, the weights lock
    rollouts        rollout/sources.py   sync / async producer / agentic rollouts
    Checkpointing   checkpoint/checkpointing.py    save, resume (+ checkpoint/catch_up.py: tracking catch-up)
    RunEvaluation   eval/in_run.py      evaluations while training runs

They are built in that order inside one cleanup scope: a start-up that fails stops what it
started (the work folder included), and `close` stops them in reverse order (the supervisor
first: a stopped engine must not be replaced). Nothing here knows about Prefect; `tasks/`
wraps the phase methods, `flows/` orders them.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from miles_core.checkpoint.checkpointing import Checkpointing
from miles_core.checkpoint.store import CheckpointStore, fetch_model_dir
from miles_core.cluster.backend import start_cluster
from miles_core.config import RunConfig
from miles_core.data import TASKS, PromptSource, rl_examples
from miles_core.engines.fleet import EngineFleet
from miles_core.eval.in_run import RunEvaluation
from miles_core.models import architecture_of, build_model, load_hf_dir, save_hf_dir
from miles_core.precision.plan import QuantPlan
from miles_core.rollout.mode import MODES
from miles_core.rollout.rollout_fn import RolloutResult
from miles_core.rollout.sources import make_rollouts
from miles_core.run.tracking import Tracker
from miles_core.run.training import adapters_of, build_trainer, train_on_rollout
from miles_core.token_fields import declare_for_model
from miles_core.weights.sync import WeightSnapshot, WeightSync


def prepare_model_dir(config: RunConfig, workdir: Path) -> Path:
    """The HF directory the run starts from: `model.path` if set, else a seeded random init."""
    if config.model.path:
        # a download lands in `workdir`, removed with the run's other temp folders
        return fetch_model_dir(config.model.path, config.checkpoint.storage_options, workdir)
    model, tok = build_model(config.model.preset, config.model.seed, config.model.context)
    return save_hf_dir(model, tok, workdir / "init_model")


def latest_state(config: RunConfig, step: int | None = None) -> dict:
    """`state.json` of the run's latest checkpoint, or of checkpoint `step` ({} if none)."""
    store = CheckpointStore(config.checkpoint.root, config.name, config.checkpoint.storage_options)
    try:
        at = store.latest_step() if step is None else step
        return {} if at is None else store.read_state(at)
    finally:
        store.close()


class RLRuntime:
    """Everything one RL run holds between steps. A plain class: Prefect passes it by reference."""

    def __init__(self, config: RunConfig, model_dir: Path, tracker: Tracker | None):
        self.config = config
        self.model_dir = model_dir
        self.tracker = tracker
        self.task = TASKS.get(config.data.task)
        d = config.data
        self.source = PromptSource(rl_examples(config), seed=d.seed, shuffle=d.shuffle)
        model, self.tokenizer = load_hf_dir(model_dir)
        self.architecture = architecture_of(model.config)
        # the run's per-token fields, a template's shape from this model (MoE routes)
        declare_for_model(config.rollout.token_fields, model.config.to_dict())
        self._rollout_step = 0  # the step `train` records in the ledger
        with contextlib.ExitStack() as started:  # unwound if any start below fails
            self.workdir = new_workdir()
            started.callback(shutil.rmtree, self.workdir, ignore_errors=True)
            self.cluster = start_cluster(config)  # where the ranks and servers run
            started.callback(self.cluster.close)
            self.fleet = EngineFleet(
                config, model, self.tokenizer, model_dir, self.workdir, self.cluster
            )
            started.callback(self.fleet.close)
            self.trainer = build_trainer(config, model_dir, self.cluster)
            started.callback(self.trainer.close)
            plan = QuantPlan.of(config, int(model.config.num_hidden_layers))
            self.weights = WeightSync(config, self.trainer, self.fleet, self.workdir, plan)
            started.callback(self.weights.close)
            if config.train.lora is not None:
                # the engines declared the adapters as zeros (the base's outputs); they start
                # on the trainer's own (its random A), so every byte check holds from step 0
                self.weights.push(self.weights.policy_version, "abort")
                if config.weight_sync.check_equal:
                    self.weights.check_base(dict(model.named_parameters()))
                    self.weights.check_equal()
            self.teachers = self._start_teachers()  # closed after the rollouts that use them
            if self.teachers is not None:
                started.callback(self.teachers.close)
            version = lambda: self.weights.engine_version  # noqa: E731 — what the engines serve
            self.rollouts = make_rollouts(
                config, self.fleet, self.tokenizer, self.task, self.source, version, self.workdir
            )
            started.callback(self.rollouts.close)
            if self.teachers is not None:  # each group scored as it completes
                self.rollouts.group_hooks.append(self.teachers.score)
            self.checkpoints = Checkpointing(
                config,
                tracker,
                self.fleet,
                self.weights,
                self.rollouts,
                self.source,
                self.tokenizer,
                self.architecture,
                model_dir,
            )
            started.callback(self.checkpoints.close)
            self.evaluation = self._start_evaluation()
            if self.evaluation is not None:
                started.callback(self.evaluation.close)
            self.fleet.supervise(self.weights.serve_current_weights, self.weights.reconnects)
            started.callback(self.fleet.stop_supervision)
            if tracker is not None:
                origin = (
                    config.model.path
                    or f"random init: preset {config.model.preset}, seed {config.model.seed}"
                )
                tracker.set_tags({"miles.init_model": origin})
            self._running = started.pop_all()  # started: `close` stops it all

    def _start_teachers(self):
        """train.distill: the teachers' engines (distill/teachers.py), or None."""
        distill = self.config.train.distill
        if distill is None:
            return None
        from miles_core.distill.teachers import TeacherFleet

        return TeacherFleet(
            distill,
            self.config.rollout.temperature,
            self.workdir,
            true_on_policy=self.config.train.true_on_policy,
            api_key=self.fleet.api_key,
            port_range=self.config.network.ports,
            student=self.fleet.engine,
        )

    def _start_evaluation(self) -> RunEvaluation | None:
        if not RunEvaluation.wanted(self.config):
            return None
        return RunEvaluation(
            self.config,
            self.tracker,
            self._score_shared,
            hold=self.rollouts.held,
            current_version=lambda: self.weights.policy_version,
        )

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int) -> RolloutResult:
        self._rollout_step = step
        result = self.fleet.with_health(self.rollouts.take(step))
        if self.teachers is not None:
            result.metrics |= self.teachers.metrics(result.samples)
        return result

    def train(self, result: RolloutResult) -> dict[str, float]:
        with self.weights.exclusive():
            version = self.weights.trainer_version
            metrics = train_on_rollout(self.trainer, self.config, result, version)
            self.weights.trained(list(adapters_of(result.groups)))
            self.checkpoints.ledger.record(self._rollout_step, result.groups)
        return metrics

    @property
    def overlaps_pushes(self) -> bool:
        """The trainer hands each policy over as a snapshot and trains on while it is pushed:
        the mode asks for it (fully_async) and the transport can push a snapshot."""
        r = self.config.rollout
        return MODES.get(r.mode).overlaps_push(r.mode_options) and self.weights.snapshots

    def snapshot_weights(self) -> WeightSnapshot:
        """The trainer's weights as the next policy version, for a push beside training."""
        return self.weights.snapshot()

    def update_weights(self, snapshot: WeightSnapshot | None = None) -> dict[str, float]:
        """Pushes the trainer's weights as the next policy version, or `snapshot` as its own;
        with weight_sync.check_equal the engines are checked bitwise after the push."""
        pause_mode = self.config.rollout.pause_mode
        self.rollouts.before_push()  # one_step_off: the batch in flight ends on the old weights
        if snapshot is None:
            version = self.weights.next_version()  # a replaced engine gets it from now on
            stats = self.weights.push(version, pause_mode)
        else:
            version = snapshot.version
            stats = self.weights.push_snapshot(snapshot, pause_mode)  # checked against it
        self.weights.engine_version = version
        self.rollouts.after_push()
        if snapshot is None and self.config.weight_sync.check_equal:
            self.check_weights_equal()
        return stats.as_metrics() | {"train/policy_version": float(version)}

    def check_weights_equal(self) -> None:
        """The engines hold exactly what was pushed (weights/sync.py `check_equal`)."""
        self.weights.check_equal()

    def engine_checksum(self) -> str:
        """sha256 of the weights the engine generates with (every engine answers it)."""
        return self.fleet.checksum()

    def is_save_step(self, step: int) -> bool:
        return self.checkpoints.is_save_step(step)

    def save(self, step: int, metrics: dict[str, float] | None = None) -> str:
        """Checkpoint of `step` (checkpoint/store.py lists its files). `metrics`: the step's phase
        metrics, kept so a resume can log them if this process dies before it flushes them."""
        uri, model_version, saved_sha = self.checkpoints.save(step, metrics)
        if self.evaluation is not None:  # dedicated / external modes score checkpoints
            self.evaluation.record_checkpoint(self.policy_version, uri, model_version, saved_sha)
        return uri

    def resume(self, step: int) -> None:
        """Continues checkpoint `step` (checkpoint/checkpointing.py): the run goes on at step + 1."""
        self.checkpoints.resume(step)

    # ------------------------------------------------------------------ evaluation
    def eval_due(self, version: int) -> bool:
        """Whether the policy after `version` training steps is evaluated (eval.mode, or agentic
        runs with agent.eval_episodes): the starting policy (shared mode), every N versions, and
        the last. The flow evaluates version 0 only in a run's first invocation."""
        return self.evaluation is not None and self.evaluation.due(version)

    def submit_evaluation(self, version: int) -> None:
        """Scores policy version `version` (the one the engines serve now): at once in shared
        mode, in the background from its checkpoint in dedicated / external mode."""
        assert self.evaluation is not None
        self.evaluation.submit(version)

    def finished_evaluations(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(version, eval/* metrics) of the evaluations that ended; `wait` for pending ones."""
        return [] if self.evaluation is None else self.evaluation.finished(wait)

    def _score_shared(self) -> tuple[dict[str, float], str | None]:
        """A shared-mode evaluation on the rollout engine, scored the rollout source's way."""
        return self.rollouts.score(), self.engine_checksum()

    def close(self) -> None:
        """Stops everything the run started, in reverse order; every component is stopped even
        if an earlier one fails to."""
        self._running.close()

    # ------------------------------------------------------------------ the components' state
    @property
    def engine(self):
        return self.fleet.engine

    @property
    def engine_process(self):
        return self.fleet.process

    @property
    def supervisor(self):
        return self.fleet.supervisor

    @property
    def policy_version(self) -> int:
        return self.weights.policy_version

    @property
    def producer(self):
        return self.rollouts.producer

    @property
    def session_process(self):
        return self.rollouts.session_process

    @property
    def store(self) -> CheckpointStore:
        return self.checkpoints.store

    @property
    def start_step(self) -> int:
        return self.checkpoints.start_step

    @property
    def last_saved_step(self) -> int | None:
        return self.checkpoints.last_saved_step


def new_workdir() -> Path:
    """A new `miles-run-*` temp folder; whoever creates one removes it when the run ends, also
    when it fails (`RLRuntime.close`, the flows' `finally`)."""
    return Path(tempfile.mkdtemp(prefix="miles-run-"))
