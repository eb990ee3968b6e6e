"""The RL runtime: the objects one run holds (engine, trainer, transport, data, tracker, store)
and the phase functions the flow's tasks call, one per phase.

Nothing here knows about Prefect; `tasks/` wraps these functions, `flows/` orders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from miles_core import rng_state
from miles_core.config import RunConfig
from miles_core.data import PromptSource, get_task, load_examples
from miles_core.device import dist_backend
from miles_core.engine_api import EngineUnavailable
from miles_core.engines import EngineSetup, make_engine
from miles_core.eval.in_run import RunEvaluation
from miles_core.eval.scoring import EvalSpec, score_policy
from miles_core.ledger import LEDGER_FILE, TrainedLedger
from miles_core.models import architecture_of, build_model, load_hf_dir, save_hf_dir
from miles_core.resume_checks import check_buffer_resumable, shape_changes
from miles_core.rollout.buffer_state import BUFFER_FILE
from miles_core.rollout.producer import RolloutProducer
from miles_core.rollout.rollout_fn import RolloutResult, generate_groups
from miles_core.rollout.supervisor import EngineSupervisor
from miles_core.sessions import SessionServerProcess
from miles_core.storage import CheckpointStore, check_checkpoint_matches, fetch_model_dir
from miles_core.tracking import Tracker
from miles_core.train.advantages import grpo_advantages, rollout_slices
from miles_core.train.backend import TrainerBackend
from miles_core.train.batch import TrainBatch
from miles_core.train.registry import make_backend
from miles_core.weights import make_transport, weights_checksum
from miles_core.weights.remote import PushFailed

log = logging.getLogger("miles")


def _exclusive_weights(method):
    """Runs the method under the runtime's weights lock, so the engine supervisor's push to a
    replaced engine never reads the trainer's weights mid-update (nor pushes beside another)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._weights_lock:
            return method(self, *args, **kwargs)

    return locked


def prepare_model_dir(config: RunConfig, workdir: Path) -> Path:
    """The HF directory the run starts from: `model.path` if set, else a seeded random init."""
    if config.model.path:
        # a download lands in `workdir`, removed with the run's other temp folders
        return fetch_model_dir(config.model.path, config.checkpoint.storage_options, workdir)
    model, tok = build_model(config.model.preset, config.model.seed)
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
        self.task = get_task(config.data.task)
        examples = load_examples(
            config.data.task,
            config.data.path,
            config.data.num_prompts,
            config.data.seed,
            config.data.storage_options,
        )
        self.source = PromptSource(examples, seed=config.data.seed, shuffle=config.data.shuffle)
        model, self.tokenizer = load_hf_dir(model_dir)
        self.architecture = architecture_of(model.config)
        seed = config.rollout.seed + config.seed
        self.workdir = new_workdir()
        self.supervisor: EngineSupervisor | None = None  # replaces a dead engine server
        self._weights_lock = threading.RLock()
        self._trained_since_push = False  # the trainer is one version ahead of policy_version
        setup = EngineSetup(
            config.rollout,
            model,
            self.tokenizer,
            model_dir,
            seed,
            self.workdir,
            config.network.ports,
        )
        built = make_engine(config.rollout.engine, setup)  # engines.py
        self.engine = built.engine
        self.engine_process = built.process  # an engine server to supervise, or None
        try:  # an engine server started above must not outlive a failed start-up
            train = config.train
            self.trainer: TrainerBackend = make_backend(
                train.backend,
                model_dir=str(model_dir),
                optim=train.model_dump(),
                loss=train.model_dump(),
                total_steps=train.num_steps * config.optimizer_steps_per_rollout,
                seed=config.seed,
                device=train.device,
            )
            ws = config.weight_sync
            self.transport = make_transport(
                ws.transport,
                bucket_bytes=ws.bucket_mb << 20,
                dtype=ws.dtype,
                group_backend=dist_backend(self.trainer.device),
                root=ws.disk_root or str(self.workdir / "pushed_weights"),
                storage_options=config.checkpoint.storage_options,
                keep=ws.keep_versions,
                delta=ws.disk_delta,
            )
            self.transport.connect([self.engine])
            self.store = CheckpointStore(
                config.checkpoint.root, config.name, config.checkpoint.storage_options
            )
        except BaseException:
            if self.engine_process is not None:
                self.engine_process.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.producer: RolloutProducer | None = None
        self.session_process: SessionServerProcess | None = None
        self.agent_rollout = None
        if config.agent.function is not None:
            try:
                self.agent_rollout = self._start_agentic_rollout()
            except BaseException:
                self.close()
                raise
        self.policy_version = 0
        self.engine_version = 0  # the version the engines serve (= policy_version after a push)
        self.start_step = 0
        self.last_saved_step: int | None = None
        self.ledger = TrainedLedger()  # sample ids trained since the last checkpoint
        self._restored_buffer: dict | None = None  # a resumed checkpoint's async buffer
        self._rollout_step = 0
        self.evaluation: RunEvaluation | None = None
        try:  # the threads and servers started so far stop if the rest of the start fails
            self._supervise_engine()
            self.evaluation = self._start_evaluation()
            if tracker is not None:
                origin = (
                    config.model.path
                    or f"random init: preset {config.model.preset}, seed {config.model.seed}"
                )
                tracker.set_tags({"miles.init_model": origin})
        except BaseException:
            self.close()
            raise

    def _supervise_engine(self) -> None:
        """Heartbeats for the engine server; a dead or hung one is replaced on the same port and
        gets the trainer's weights before it serves (`_serve_current_weights`)."""
        if self.engine_process is None:
            return
        r, transport = self.config.rollout, self.config.weight_sync.transport
        restarts = r.max_engine_restarts
        if not self.transport.reconnects and restarts:
            log.info(
                "weight_sync.transport %s cannot reconnect to a replaced engine server: a dead "
                "engine fails the run (replacement needs shared_memory or disk)",
                transport,
            )
            restarts = 0
        self.supervisor = EngineSupervisor(
            self.engine_process,
            self._serve_current_weights,
            interval_s=r.health_interval_s,
            timeout_s=r.health_timeout_s,
            max_restarts=restarts,
        ).start()
        self.engine.supervisor = self.supervisor

    @_exclusive_weights
    def _serve_current_weights(self) -> None:
        """Called by the supervisor for a fresh engine server, before it serves: the transport
        reconnects (a disk transport's next push is full) and the trainer's current weights go
        out with their version; `check_equal` verifies them."""
        version = self.policy_version + int(self._trained_since_push)
        self.transport.connect([self.engine])
        stats = self._push_now(version, "abort")
        log.warning(
            "replaced engine server got policy version %d (%d bytes in %.2f s)",
            version,
            stats.bytes,
            stats.seconds,
        )
        if self.config.weight_sync.check_equal:
            self._check_weights_now()

    def _surviving(self, what: str, call, *args):
        """`call(*args)` (a push or a check over HTTP); if it fails because the engine server
        died, waits for the replacement and makes the call once more."""
        if self.supervisor is None:
            return call(*args)
        seen = self.supervisor.wait_serving()
        try:
            return call(*args)
        except (PushFailed, EngineUnavailable) as e:
            self.supervisor.wait_for_replacement(seen, e)
        log.warning("repeating the %s on the replaced engine server", what)
        return call(*args)

    def _with_engine_health(self, result: RolloutResult) -> RolloutResult:
        if self.supervisor is not None:
            result.metrics |= self.supervisor.metrics()
        return result

    def _start_agentic_rollout(self):
        """The session server in front of the engine server, and the rollout function."""
        from miles_core.agents.layers import RolloutSetup, load_plugin
        from miles_core.agents.rollout import AgenticRollout
        from miles_core.agents.session_generate import make_session_generate

        agent = self.config.agent
        assert self.engine_process is not None  # the config requires rollout.engine: server
        check_family_matches(agent.family, self.tokenizer)
        self.session_process = SessionServerProcess(
            self.engine_process.url,
            agent.family,
            log_path=self.workdir / "sessions.log",
            args=(
                "--max-tokens",
                str(agent.max_tokens),
                *(f"--token-field={f}" for f in self.config.rollout.token_fields),
            ),
            port_range=self.config.network.ports,
        ).start()
        if agent.generate_function:
            generate = load_plugin(agent.generate_function, "agent.generate_function")
        else:
            run_agent = load_plugin(agent.function, "agent.function")
            generate = make_session_generate(run_agent, agent.timeout_s)
        hooks = None
        if agent.reward_function or agent.group_reward_function:
            from miles_core.agents.rewards import RewardHooks

            def hook(path: str | None, what: str):
                return load_plugin(path, what, want_async=False) if path else None

            hooks = RewardHooks(
                hook(agent.reward_function, "agent.reward_function"),
                hook(agent.group_reward_function, "agent.group_reward_function"),
                agent.reward_timeout_s,
            )
        setup = RolloutSetup(self.config, self.source, self.session_process.url, generate, hooks)
        return AgenticRollout(setup)

    # ------------------------------------------------------------------ evaluation
    def _start_evaluation(self) -> RunEvaluation | None:
        if not RunEvaluation.wanted(self.config):
            return None
        return RunEvaluation(
            self.config,
            self.tracker,
            self._score_shared,
            hold=lambda: self.producer.held() if self.producer else contextlib.nullcontext(),
            current_version=lambda: self.policy_version,
        )

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
        """A shared-mode evaluation on the rollout engine: the fixed eval prompts of data.task,
        or the agent episodes on fixed tasks of agentic runs."""
        c = self.config
        if self.agent_rollout is not None:
            examples = self.task.generate(c.agent.eval_episodes, seed=c.data.seed + 1_000_003)
            metrics = asyncio.run(self.agent_rollout.evaluate(examples))
        else:
            metrics = score_policy(self.engine, self.tokenizer, EvalSpec.from_run(c))
        return metrics, self.engine_checksum()

    def engine_checksum(self) -> str:
        """sha256 of the weights the engine generates with (every engine answers it)."""
        return self._surviving("weights checksum", self.engine.weights_checksum)

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int) -> RolloutResult:
        r = self.config.rollout
        self._rollout_step = step  # the step `train` records in the ledger
        if self.agent_rollout is not None:
            from miles_core.agents.layers import RolloutInput

            out = asyncio.run(self.agent_rollout(RolloutInput(step, self.engine_version)))
            return self._with_engine_health(RolloutResult(out.groups, out.metrics))
        if r.mode == "sync":
            prompts = self.source.next_batch(r.prompts_per_step)
            result = generate_groups(self.engine, self.tokenizer, self.task, prompts, r, step)
            return self._with_engine_health(result)
        if self.producer is None:  # first call: after a resume has set the data position
            if r.mode == "one_step_off":  # one batch ahead, pushes between batches
                r = r.model_copy(update={"max_staleness": 1, "stale_policy": "pace"})
            self.producer = RolloutProducer(
                self.engine,
                self.tokenizer,
                self.task,
                self.source,
                r,
                version=lambda: self.engine_version,
                first_group=step * r.prompts_per_step,
            )
            if self._restored_buffer is not None:  # groups buffered at the resumed checkpoint
                self.producer.restore(self._restored_buffer)
                self._restored_buffer = None
            self.producer.start()
        return self._with_engine_health(self.producer.take(step))

    @_exclusive_weights
    def train(self, result: RolloutResult) -> dict[str, float]:
        cfg = self.config
        advantages = grpo_advantages(result.groups, cfg.train.normalize_advantage_std)
        batch = TrainBatch.from_samples(result.samples, advantages, cfg.rollout.temperature)
        batch.old_log_probs = self.trainer.compute_log_probs(batch)
        per_step: list[dict[str, float]] = []
        # global_batch_size counts rollouts: a multi-leaf agent episode stays in one step
        for start, end in rollout_slices(batch.sample_ids, cfg.train.global_batch_size):
            per_step.append(self.trainer.train_step(batch.slice(start, end), loss=cfg.train.loss))
        self._trained_since_push = True
        self.ledger.record(self._rollout_step, result.groups)
        keys = per_step[0].keys()
        return {f"train/{k}": sum(m[k] for m in per_step) / len(per_step) for k in keys}

    def update_weights(self) -> dict[str, float]:
        with self._weights_lock:  # a replaced engine gets this version from now on
            self.policy_version += 1
            self._trained_since_push = False
        r = self.config.rollout
        if self.producer is not None and r.mode == "one_step_off":
            self.producer.wait_idle()  # the batch in flight finishes on the old weights
        stats = self._push(self.policy_version, r.pause_mode)
        self.engine_version = self.policy_version
        if self.producer is not None:
            self.producer.notify_version()
        if self.config.weight_sync.check_equal:
            self.check_weights_equal()
        return stats.as_metrics() | {"train/policy_version": float(self.policy_version)}

    def _push(self, version: int, pause_mode: str):
        """Pushes the trainer's weights as `version`; a push that meets a dead engine server
        waits for its replacement (which got the trainer's weights) and is made once more."""
        return self._surviving(f"push of version {version}", self._push_now, version, pause_mode)

    @_exclusive_weights
    def _push_now(self, version: int, pause_mode: str):
        # the transport reads the trainer (buckets or shards) with weight_sync's bucket and dtype
        return self.transport.push(self.trainer, version, pause_mode)

    def _push_dtype(self) -> torch.dtype | None:
        name = self.config.weight_sync.dtype
        return None if name == "float32" else getattr(torch, name)

    def check_weights_equal(self) -> None:
        """The engines hold exactly what was pushed: the trainer's weights, in the push dtype,
        loaded into the engine's own (fp32) parameters."""
        self._surviving("weights check", self._check_weights_now)

    @_exclusive_weights
    def _check_weights_now(self) -> None:
        dtype = self._push_dtype()
        expected = [
            (n, t.to(dtype).to(t.dtype) if dtype is not None else t)
            for b in self.trainer.named_weights(64 << 20)
            for n, t in b
        ]
        if self.engine.weights_checksum() != weights_checksum(expected):
            where = getattr(self.engine, "url", "in this process")
            raise RuntimeError(f"engine weights ({where}) differ from the trainer's after the push")

    def is_save_step(self, step: int) -> bool:
        """Every checkpoint.interval steps, and the last step."""
        interval = self.config.checkpoint.interval
        last = step == self.config.train.num_steps - 1
        return last or (bool(interval) and (step + 1) % interval == 0)

    def save(self, step: int, metrics: dict[str, float] | None = None) -> str:
        """Checkpoint of `step` (storage.py lists its files). `metrics`: the step's phase
        metrics, kept so a resume can log them if this process dies before it flushes them."""
        checksum = self.engine_checksum()
        saved_sha = self._saved_weights_checksum(checksum)  # of the files (differs for bf16)
        generator = getattr(self.engine, "generator", None)  # servers seed every request
        buffer = self.producer.snapshot() if self.producer else None
        state = {
            "step": step,
            "policy_version": self.policy_version,
            "weights_sha256": checksum,
            "saved_weights_sha256": saved_sha,
            "init_model": self.config.model.path,
            # with a producer: after every admitted group (the buffer holds those not trained)
            "data": buffer["source_state"] if buffer else self.source.state(),
            "engine_rng": rng_state.encode_generator(generator) if generator is not None else None,
            "rng": rng_state.capture(),
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "architecture": self.architecture,
            "config": self.config.model_dump(mode="json"),
            "step_metrics": metrics or {},
        }
        files = {LEDGER_FILE: self.ledger.to_json()}
        if buffer is not None:
            files[BUFFER_FILE] = buffer

        def write(directory: Path) -> None:
            with self._weights_lock:  # never beside a push to a replaced engine (SPMD calls)
                self.trainer.save(str(directory))
            self.tokenizer.save_pretrained(str(directory))

        uri = self.store.save(step, write, state, files)
        self.last_saved_step = step
        self.ledger.saved(step)
        model_version = None
        if self.tracker:
            if self.config.tracking.register_policy:
                model_version = self.tracker.log_policy_version(
                    self.config.name, step, self.policy_version, uri, {"weights_sha256": saved_sha}
                )
            self.tracker.set_tags({"miles.last_checkpoint": uri})
        if self.evaluation is not None:  # dedicated / external modes score checkpoints
            self.evaluation.record_checkpoint(self.policy_version, uri, model_version, saved_sha)
        return uri

    def _saved_weights_checksum(self, engine_checksum: str) -> str:
        """sha256 of the weights the checkpoint files hold: the trainer's, which the engine
        holds as they are unless pushes round them (weight_sync.dtype)."""
        if self._push_dtype() is None:
            return engine_checksum
        with self._weights_lock:
            return weights_checksum(n_t for b in self.trainer.named_weights(64 << 20) for n_t in b)

    def resume(self, step: int) -> None:
        """Loads checkpoint `step` of this run: weights, optimizer, LR schedule, data position,
        RNG states, version, the async buffer (handed to the producer on the first rollout);
        the run continues at step + 1. A checkpoint other than the latest becomes the latest
        (later ones belong to an abandoned lineage and are overwritten as the run gets there)."""
        uri = self.store.uri(step)
        check_checkpoint_matches(self.architecture, uri, self.config.checkpoint.storage_options)
        state = self.store.read_state(step)
        buffer = self.store.read_json(step, BUFFER_FILE)
        check_buffer_resumable(buffer, self.config, step)
        changed = shape_changes(state.get("config"), self.config)
        if changed:
            log.warning(
                "resuming step %d with %s: training continues, but not bit-identically to an "
                "uninterrupted run",
                step,
                ", ".join(changed),
            )
        local = self.store.fetch(step)
        with self._weights_lock:  # a replacement engine never gets half-loaded weights
            self.trainer.load(str(local))
        self.source.load_state(state["data"])
        if state.get("engine_rng") and hasattr(self.engine, "generator"):
            rng_state.decode_generator(self.engine.generator, state["engine_rng"])
        if state.get("rng"):
            rng_state.restore(state["rng"])
        if self.config.rollout.mode != "sync":
            self._restored_buffer = buffer
        self.policy_version = self.engine_version = int(state["policy_version"])
        self._push(self.policy_version, self.config.rollout.pause_mode)
        self.start_step = self.last_saved_step = int(state["step"])
        self.start_step += 1
        self.ledger = TrainedLedger(previous_step=step)
        latest = self.store.latest_step()
        if latest != step:
            later = [s for s in self.store.steps() if s > step]
            log.warning(
                "resuming from step %d, not the latest (%s): checkpoints %s belong to the "
                "abandoned continuation and are overwritten as the run reaches them",
                step,
                latest,
                later,
            )
            self.store.mark_latest(step)
        self._record_what_the_dead_process_missed(step, state, uri)

    def _record_what_the_dead_process_missed(self, step: int, state: dict, uri: str) -> None:
        """A process killed just after writing checkpoint `step` may not have flushed that
        step's metrics or registered the checkpoint as a policy version: both are done now."""
        t = self.tracker
        metrics = state.get("step_metrics") or {}
        if t is None:
            return
        key = next((k for k in ("rollout/reward_mean", *metrics) if k in metrics), None)
        if key is not None:
            logged = {m.step for m in t.client.get_metric_history(t.run_id, key)}
            if step not in logged:
                log.warning("step %d's metrics were never logged: logging them now", step)
                t.log_metrics(metrics, step)
                t.flush()
        if self.config.tracking.register_policy and state.get("weights_sha256"):
            found = t.client.search_model_versions(
                f"name='{self.config.name}' and run_id='{t.run_id}'"
            )
            if not any(mv.tags.get("step") == str(step) for mv in found):
                log.warning("checkpoint %s was never registered: registering it now", uri)
                t.log_policy_version(
                    self.config.name,
                    step,
                    int(state["policy_version"]),
                    uri,
                    {"weights_sha256": state.get("saved_weights_sha256", state["weights_sha256"])},
                )
                t.set_tags({"miles.last_checkpoint": uri})

    def close(self) -> None:
        """Stops everything the run started; the engine process is stopped even if an earlier
        step of the shutdown fails."""
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()  # first: a stopped engine must not be replaced
        try:
            if getattr(self, "evaluation", None) is not None:
                self.evaluation.close()
            if self.producer is not None:
                self.producer.stop()
            close_transport = getattr(self.transport, "close", None)
            if close_transport is not None:  # while the engines still answer
                close_transport()
            self.trainer.close()
            self.store.close()
        finally:
            if self.session_process is not None:
                self.session_process.stop()
            self.engine.close()
            if self.engine_process is not None:
                self.engine_process.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)


def check_family_matches(name: str, tokenizer) -> None:
    """The session server's TITO family must tokenize like the model (miles_core/tito/check.py)."""
    from miles_core.tito.check import check_family_matches as check

    check(name, tokenizer)


def new_workdir() -> Path:
    """A new `miles-run-*` temp folder; whoever creates one removes it when the run ends, also
    when it fails (`RLRuntime.close`, the flows' `finally`)."""
    return Path(tempfile.mkdtemp(prefix="miles-run-"))
