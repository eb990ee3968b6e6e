"""The RL runtime: the objects one run holds (engine, trainer, transport, data, tracker, store)
and the phase functions the flow's tasks call, one per phase.

Nothing here knows about Prefect; `tasks/` wraps these functions, `flows/` orders them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from miles_core.config import RunConfig
from miles_core.data import PromptSource, get_task, load_examples
from miles_core.models import architecture_of, build_model, load_hf_dir, save_hf_dir
from miles_core.rollout.embedded import EmbeddedEngine
from miles_core.rollout.http_engine import EngineProcess, HttpEngine
from miles_core.rollout.producer import RolloutProducer
from miles_core.rollout.rollout_fn import RolloutResult, generate_groups
from miles_core.rollout.serving import ServingEngine
from miles_core.sessions import SessionServerProcess
from miles_core.storage import CheckpointStore, check_checkpoint_matches, fetch_model_dir
from miles_core.tracking import Tracker
from miles_core.train.advantages import grpo_advantages, rollout_slices
from miles_core.train.batch import TrainBatch
from miles_core.train.fsdp import FSDPBackend
from miles_core.weights import make_transport, mismatched_tensors, weights_checksum

log = logging.getLogger("miles")


def prepare_model_dir(config: RunConfig, workdir: Path) -> Path:
    """The HF directory the run starts from: `model.path` if set, else a seeded random init."""
    if config.model.path:
        return fetch_model_dir(config.model.path, config.checkpoint.storage_options)
    model, tok = build_model(config.model.preset, config.model.seed)
    return save_hf_dir(model, tok, workdir / "init_model")


def latest_state(config: RunConfig) -> dict:
    """`state.json` of the run's latest checkpoint ({} if it has none)."""
    store = CheckpointStore(config.checkpoint.root, config.name, config.checkpoint.storage_options)
    try:
        latest = store.latest_step()
        return {} if latest is None else store.read_state(latest)
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
        self.engine_process: EngineProcess | None = None
        if config.rollout.engine == "server":
            self.engine = self._start_engine_server(model_dir, seed)
        elif config.rollout.engine == "serving":
            batch = config.rollout.prompts_per_step * config.rollout.n_samples_per_prompt
            self.engine = ServingEngine(
                model,
                self.tokenizer,
                seed=seed,
                max_running=batch,
                dtype=config.rollout.dtype,
                scheduler="caller",
            )
        else:
            self.engine = EmbeddedEngine(model, self.tokenizer, seed=seed)
        try:  # an engine server started above must not outlive a failed start-up
            train = config.train
            self.trainer = FSDPBackend(
                str(model_dir),
                optim=train.model_dump(),
                loss=train.model_dump(),
                total_steps=train.num_steps * config.optimizer_steps_per_rollout,
                seed=config.seed,
            )
            ws = config.weight_sync
            self.transport = make_transport(
                ws.transport,
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
        if tracker is not None:
            origin = (
                config.model.path
                or f"random init: preset {config.model.preset}, seed {config.model.seed}"
            )
            tracker.set_tags({"miles.init_model": origin})

    def _start_engine_server(self, model_dir: Path, seed: int) -> HttpEngine:
        """The serving engine as a subprocess on 127.0.0.1, stopped by PID in `close`."""
        r = self.config.rollout
        batch = r.prompts_per_step * r.n_samples_per_prompt
        # async modes may have 1 + max_staleness steps of groups in flight at once
        running = batch if r.mode == "sync" else batch * (1 + r.max_staleness)
        args = ["--max-running", str(running), "--seed", str(seed), "--dtype", r.dtype]
        if r.engine_threads:
            args += ["--threads", str(r.engine_threads)]
        self.engine_process = EngineProcess(
            model_dir, args=args, log_path=self.workdir / "engine.log"
        ).start()
        # our engine server takes SGLang's batch form: one call per group
        return HttpEngine(
            self.engine_process.url, concurrency=batch, batch_size=r.n_samples_per_prompt
        )

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
            args=("--max-tokens", str(agent.max_tokens)),
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

    def eval_due(self, version: int) -> bool:
        """Whether the policy after `version` training steps is evaluated (agentic runs with
        agent.eval_episodes): the starting policy (version 0), every agent.eval_every steps,
        and the last. A resumed run does not evaluate its starting point again."""
        a = self.config.agent
        if self.agent_rollout is None or a.eval_episodes == 0:
            return False
        every = a.eval_every and version % a.eval_every == 0
        return version in (0, self.config.train.num_steps) or bool(every)

    def evaluate(self) -> dict[str, float]:
        """Agent episodes on the fixed evaluation tasks with the weights the engines serve. An
        evaluation that fails is logged with its reason (`eval/errors`); training goes on."""
        assert self.agent_rollout is not None
        c = self.config
        version = {"eval/policy_version": float(self.engine_version)}
        try:
            examples = self.task.generate(c.agent.eval_episodes, seed=c.data.seed + 1_000_003)
            return asyncio.run(self.agent_rollout.evaluate(examples)) | version
        except Exception as e:  # noqa: BLE001  (an evaluation never stops training)
            log.warning("evaluation of policy version %d failed: %r", self.engine_version, e)
            return {"eval/errors": 1.0} | version

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int) -> RolloutResult:
        r = self.config.rollout
        if self.agent_rollout is not None:
            from miles_core.agents.layers import RolloutInput

            out = asyncio.run(self.agent_rollout(RolloutInput(step, self.engine_version)))
            return RolloutResult(out.groups, out.metrics)
        if r.mode == "sync":
            prompts = self.source.next_batch(r.prompts_per_step)
            return generate_groups(self.engine, self.tokenizer, self.task, prompts, r, step)
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
            ).start()
        return self.producer.take(step)

    def train(self, result: RolloutResult) -> dict[str, float]:
        cfg = self.config
        advantages = grpo_advantages(result.groups, cfg.train.normalize_advantage_std)
        batch = TrainBatch.from_samples(result.samples, advantages, cfg.rollout.temperature)
        batch.old_log_probs = self.trainer.compute_log_probs(batch)
        per_step: list[dict[str, float]] = []
        # global_batch_size counts rollouts: a multi-leaf agent episode stays in one step
        for start, end in rollout_slices(batch.sample_ids, cfg.train.global_batch_size):
            per_step.append(self.trainer.train_step(batch.slice(start, end), loss="policy"))
        keys = per_step[0].keys()
        return {f"train/{k}": sum(m[k] for m in per_step) / len(per_step) for k in keys}

    def update_weights(self) -> dict[str, float]:
        self.policy_version += 1
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
        dtype = self._push_dtype()
        if getattr(self.transport, "pushes_from_trainer", False):  # p2p: every rank sends
            return self.transport.push_from(self.trainer, version, pause_mode, dtype)
        bucket = self.config.weight_sync.bucket_mb << 20
        return self.transport.push(self.trainer.named_weights(bucket, dtype), version, pause_mode)

    def _push_dtype(self) -> torch.dtype | None:
        name = self.config.weight_sync.dtype
        return None if name == "float32" else getattr(torch, name)

    def check_weights_equal(self) -> None:
        """The engines hold exactly what was pushed: the trainer's weights, in the push dtype,
        loaded into the engine's own (fp32) parameters."""
        dtype = self._push_dtype()
        expected = [
            (n, t.to(dtype).to(t.dtype) if dtype is not None else t)
            for b in self.trainer.named_weights(64 << 20)
            for n, t in b
        ]
        if isinstance(self.engine, HttpEngine):  # compare checksums over HTTP
            if self.engine.weights_checksum() != weights_checksum(expected):
                raise RuntimeError(
                    f"engine at {self.engine.url} holds weights that differ from the trainer's"
                )
            return
        bad = mismatched_tensors(expected, self.engine.named_tensors())
        if bad:
            raise RuntimeError(
                f"engine weights differ from the trainer's after the push: {bad[:5]}"
            )

    def is_save_step(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return bool(interval) and (step + 1) % interval == 0

    def save(self, step: int) -> str:
        if isinstance(self.engine, HttpEngine):
            checksum = self.engine.weights_checksum()
        else:
            checksum = weights_checksum(self.engine.named_tensors().items())
        generator = getattr(self.engine, "generator", None)  # servers seed every request
        state = {
            "step": step,
            "policy_version": self.policy_version,
            "weights_sha256": checksum,
            "init_model": self.config.model.path,
            "data": self.producer.data_state() if self.producer else self.source.state(),
            "engine_rng": base64.b64encode(generator.get_state().numpy().tobytes()).decode()
            if generator is not None
            else None,
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "architecture": self.architecture,
        }

        def write(directory: Path) -> None:
            self.trainer.save(str(directory))
            self.tokenizer.save_pretrained(str(directory))

        uri = self.store.save(step, write, state)
        self.last_saved_step = step
        if self.tracker:
            self.tracker.set_tags({"miles.last_checkpoint": uri})
            if self.config.tracking.register_policy:
                self.tracker.log_policy_version(
                    self.config.name, step, self.policy_version, uri, {"weights_sha256": checksum}
                )
        return uri

    def resume(self, step: int) -> None:
        """Loads a checkpoint of this run: weights, optimizer, data position, RNG, version."""
        uri = self.store.uri(step)
        check_checkpoint_matches(self.architecture, uri, self.config.checkpoint.storage_options)
        local = self.store.fetch(step)
        state = self.store.read_state(step)
        self.trainer.load(str(local))
        self.source.load_state(state["data"])
        if state.get("engine_rng") and hasattr(self.engine, "generator"):
            raw = bytearray(base64.b64decode(state["engine_rng"]))
            self.engine.generator.set_state(torch.frombuffer(raw, dtype=torch.uint8))
        self.policy_version = self.engine_version = int(state["policy_version"])
        self._push(self.policy_version, self.config.rollout.pause_mode)
        self.start_step = self.last_saved_step = int(state["step"])
        self.start_step += 1

    def close(self) -> None:
        """Stops everything the run started; the engine process is stopped even if an earlier
        step of the shutdown fails."""
        try:
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
            if isinstance(self.engine, ServingEngine | HttpEngine):
                self.engine.close()
            if self.engine_process is not None:
                self.engine_process.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)


def check_family_matches(name: str, tokenizer) -> None:
    """The session server's TITO family must tokenize like the model: a one-message prompt has
    to give the same ids either way (else the engine would read ids from another vocabulary)."""
    from miles_core.tito import get_family

    probe = [{"role": "user", "content": "list the files"}]
    ours = get_family(name).prompt(probe)
    model = tokenizer.apply_chat_template(
        probe, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    model = list(model["input_ids"] if isinstance(model, dict) else model)
    if ours != model:
        raise ValueError(
            f"agent.family {name!r} does not tokenize like the model: {ours[:12]}… against the "
            f"model tokenizer's {model[:12]}…; choose the family of the model's tokenizer"
        )


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="miles-run-"))
