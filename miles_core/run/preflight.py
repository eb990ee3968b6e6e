"""Checks that run before anything starts: a bad config, dataset or checkpoint fails here,
with a message that says what to fix, not minutes (or a whole run) later inside a flow."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import fsspec

from miles_core.checkpoint.resume_checks import check_backend_resumable, check_buffer_resumable
from miles_core.checkpoint.store import CheckpointStore, check_checkpoint_matches
from miles_core.config import RunConfig
from miles_core.data import TASKS, rl_examples, sft_examples
from miles_core.data.tasks import Example
from miles_core.models import architecture_of, build_tokenizer
from miles_core.models.builder import preset_config
from miles_core.rollout.buffer_state import BUFFER_FILE
from miles_core.run.tracking import check_tracking_uri, resolve_tracking_uri


def _model_config(config: RunConfig) -> dict:
    """The starting model's config.json (read alone, not the whole model) or the preset's."""
    if config.model.path:
        url = f"{config.model.path.rstrip('/')}/config.json"
        try:
            with fsspec.open(url, "rt", **config.checkpoint.storage_options) as f:
                found = json.load(f)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"model.path {config.model.path!r} is not a model directory (no config.json)"
            ) from e
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{url}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
            ) from e
        if not isinstance(found, dict):
            raise ValueError(f"{url}: not a model config (a JSON object)")
        return found
    tok = build_tokenizer()
    return preset_config(
        config.model.preset, len(tok), tok.pad_token_id, tok.eos_token_id, config.model.context
    ).to_dict()


def _check_reused(path: str, storage_options: dict) -> None:
    fs, root = fsspec.core.url_to_fs(path.rstrip("/"), **storage_options)
    if not fs.exists(f"{root}/config.json"):
        raise FileNotFoundError(
            f"sft.reuse {path!r} is not a model directory (no config.json): give the "
            "step_<n> directory an SFT run saved"
        )


def _tokenizer(config: RunConfig):
    if config.model.path and "://" not in config.model.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.model.path)
    return build_tokenizer() if not config.model.path else None  # remote: checked when loaded


def _check_lengths(
    rows: list[Example], tok, budget: tuple[str, int], context: int, where: str, what: str
) -> None:
    """Each prompt (an SFT row: with its answer) plus `budget` (the setting that bounds the new
    tokens of one model call, and its value) fits the context."""
    from miles_core.rollout.rollout_fn import encode_prompt

    setting, tokens = budget
    for i, ex in enumerate(rows, start=1):
        n = len(encode_prompt(tok, ex.prompt))
        if what == "sft" and ex.answer is not None:
            n += len(tok.encode(ex.answer, add_special_tokens=False)) + 1
        if n + tokens > context:
            extra = f" + {setting} {tokens}" if tokens else ""
            raise ValueError(
                f"{where}: row {i} is {n} tokens{extra}, more than the model's context of {context}"
            )


def _check_episode_budget(config: RunConfig, task, context: int) -> None:
    """A sandbox environment task (`envs/sandbox_tasks.py`): for one task of every kind, each
    scripted `run` call fits agent.max_tokens, the scripted solution's calls fit agent.max_turns,
    and its whole episode fits the token budget (agent.max_session_tokens and the context).
    Otherwise no episode of that kind could succeed: refused, naming the kind and the numbers."""
    from miles_core.envs.demonstration import call_lengths, demonstration
    from miles_core.envs.sandbox import SandboxLimits
    from miles_core.rollout.sources import episode_metadata
    from miles_core.tito import build_family

    a = config.agent
    family = build_family(a.family)
    kinds = len(task.kinds) + len(getattr(task, "eval_kinds", ()))
    draw = getattr(task, "evaluation", task.generate)
    limits = SandboxLimits(**episode_metadata(config, task)["limits"])  # what episodes get
    budgets = [(v, what) for v, what in ((a.max_session_tokens, "agent.max_session_tokens"),
               (context, "the model's context")) if v]  # fmt: skip
    for ex in draw(kinds, config.data.seed):
        env = task.environment_of(ex.label)
        longest = max(call_lengths(env, family), default=0)
        if longest > a.max_tokens:
            raise ValueError(
                f"agent.max_tokens ({a.max_tokens}) cannot fit one tool call of a {env.kind!r} "
                f"task: its scripted run call is {longest} tokens"
            )
        if len(env.solution) > a.max_turns:
            raise ValueError(
                f"agent.max_turns ({a.max_turns}) cannot fit the scripted solution of a "
                f"{env.kind!r} task ({len(env.solution)} tool calls): no such episode can succeed"
            )
        ids, _, _ = demonstration(env, family, limits)
        for budget, what in budgets:
            if len(ids) > budget:
                raise ValueError(
                    f"{what} ({budget} tokens) cannot fit the scripted episode of a "
                    f"{env.kind!r} task ({len(ids)} tokens with its tool results)"
                    + ("; raise model.context" if what == "the model's context" else "")
                )


def _call_budget(config: RunConfig) -> tuple[str, int]:
    """The new tokens one model call may add to a prompt: an agent's call (the session server
    caps each at agent.max_tokens), else a rollout's."""
    if config.agent.function is not None:
        return "agent.max_tokens", config.agent.max_tokens
    return "rollout.max_new_tokens", config.rollout.max_new_tokens


def _check_cluster(config: RunConfig) -> None:
    """The cluster backend can start the run (the Ray cluster answers, …)."""
    from miles_core.cluster.backend import CLUSTERS

    c = config.cluster
    CLUSTERS.get(c.backend).check(config, CLUSTERS.options(c.backend, c.backend_options))


def _check_plugins(config: RunConfig) -> None:
    """Every agent plug-in path imports and names a callable of the right kind."""
    from miles_core.agents.layers import load_plugin

    a = config.agent
    for path, what, want_async in (
        (a.function, "agent.function", True),
        (a.generate_function, "agent.generate_function", True),
        (a.reward_function, "agent.reward_function", False),
        (a.group_reward_function, "agent.group_reward_function", False),
    ):
        if path:
            load_plugin(path, what, want_async)
    if a.function is None and getattr(TASKS.get(config.data.task), "agentic", False):
        raise ValueError(
            f"task {config.data.task!r} is agentic (its rewards come from episodes in its "
            "environment, not from scoring a completion): set agent.function, e.g. "
            "miles_core.envs.sandbox_agent:run_agent"
        )
    if a.eval_episodes and not callable(getattr(TASKS.get(config.data.task), "generate", None)):
        raise ValueError(
            f"agent.eval_episodes: task {config.data.task!r} has no generate(n, seed) to draw "
            "evaluation tasks from"
        )


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_roles(rows: list[Example], where: str) -> None:
    """Chat prompts use the roles chat templates know."""
    for i, ex in enumerate(rows, start=1):
        if isinstance(ex.prompt, list):
            for j, message in enumerate(ex.prompt, start=1):
                role = message.get("role") if isinstance(message, dict) else None
                if role not in CHAT_ROLES:
                    raise ValueError(
                        f"{where}: row {i}: message {j} has role {role!r}; known: "
                        f"{', '.join(CHAT_ROLES)}"
                    )


def _check_adapters(config: RunConfig, rows: list[Example], where: str) -> None:
    """Each row's `adapter` is one the run trains; with several, every row names one."""
    lora = config.train.lora
    named = [(i, ex.adapter) for i, ex in enumerate(rows, start=1) if ex.adapter is not None]
    if lora is None:
        if named:
            raise ValueError(f"{where}: row {named[0][0]} names an adapter, but train.lora is off")
        return
    for i, adapter in named:
        if adapter not in lora.adapters:
            raise ValueError(
                f"{where}: row {i} names adapter {adapter!r}, none of train.lora.adapters "
                f"{lora.adapters}"
            )
    if len(lora.adapters) > 1 and len(named) < len(rows):
        first = next(i for i, ex in enumerate(rows, start=1) if ex.adapter is None)
        raise ValueError(
            f"{where}: row {first} names no adapter: a multi-LoRA run's rows each name one of "
            f"{lora.adapters} in their 'adapter' field"
        )


def _check_model(config: RunConfig, model_config: dict) -> None:
    """The starting model, read by header only: sizes, safetensors files, the memory the run
    needs against what the machine has (models/check.py)."""
    from miles_core.device import resolve_device
    from miles_core.models.check import check_memory, check_model_dir

    where = f"model.path {config.model.path!r}" if config.model.path else "model.preset"
    gpu_memory = None
    if resolve_device(config.train.device).type == "cuda":
        import torch

        one = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        gpu_memory = one * config.train.world_size  # FSDP shards the trainer's state
    check_memory(model_config, where, gpu_memory=gpu_memory)
    from miles_core.train.backend import BACKENDS

    # a backend may refuse a model it cannot build or split (Megatron: its converter's
    # architectures, heads and layers that divide by the parallel layout)
    check = getattr(BACKENDS.get(config.train.backend), "check_model", None)
    if check is not None:
        check(config.train.model_dump(), model_config, where)
    from miles_core.engines.registry import ENGINES

    # the run's token fields for this model (a template may refuse it: MoE routes of a dense
    # model), and an engine may refuse a model its forward does not implement (the serving
    # engine: its model family's runner) or fields it does not fill
    fields = [_field_for(path, model_config, where) for path in config.rollout.token_fields]
    asked = [f for f in fields if f.request_flag]
    reason = ENGINES.get(config.rollout.engine).refuses(model_config, asked)
    if reason is not None:
        raise ValueError(f"rollout.engine {config.rollout.engine} cannot run {where}: {reason}")
    if config.train.true_on_policy:
        from miles_core.true_on_policy.contract import TRUE_ON_POLICY

        reason = TRUE_ON_POLICY.model_refused(model_config)
        if reason is not None:
            raise ValueError(f"train.true_on_policy cannot run {where}: {reason}")
    _check_precision(config, model_config, where)
    _check_lora(config, model_config, where)
    if config.model.path:
        check_model_dir(config.model.path, model_config, config.checkpoint.storage_options)


def _check_precision(config: RunConfig, model_config: dict, where: str) -> None:
    """rollout.precision and precision.keep_bf16 fit the model's linear weights (shapes the
    format can block, keep-list names that exist), read from a weightless copy of the model."""
    from miles_core.models.check import tensor_shapes
    from miles_core.precision.plan import QuantPlan

    plan = QuantPlan.of(config, int(model_config["num_hidden_layers"]))
    if plan is None:
        return
    refused = plan.refused(tensor_shapes(model_config))
    if refused:
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise ValueError(f"{where}: {'; '.join(refused[:3])}{more}")


def _check_lora(config: RunConfig, model_config: dict, where: str) -> None:
    """train.lora's target and excluded modules name linear layers of the model the engines
    can serve adapters on (read from a weightless copy)."""
    lora = config.train.lora
    if lora is None:
        return
    from miles_core.lora.targets import resolve_targets
    from miles_core.models.check import meta_model

    try:
        resolve_targets(meta_model(model_config), lora.target_modules, lora.exclude_modules)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _field_for(path: str, model_config: dict, where: str):
    """Token field `path` for the run's model; ValueError naming it when the model cannot have
    it."""
    from miles_core.token_fields import load_token_fields

    try:
        return load_token_fields([path])[0].for_model(model_config)
    except ValueError as e:
        raise ValueError(f"rollout.token_fields {path}: {where}: {e}") from None


def _check_unclaimed(config: RunConfig, names: list[str]) -> None:
    """No other live run holds one of the names (checkpoint/run_lock.py); a dead owner's lock is taken
    over by the claim."""
    from miles_core.checkpoint.run_lock import check_unclaimed

    ck = config.checkpoint
    for name in names:
        check_unclaimed(ck.root, name, ck.storage_options)


def run_names(config: RunConfig) -> list[str]:
    """The checkpoint folders a run writes: its own, and its SFT warm start's."""
    return [config.name] + ([f"{config.name}-sft"] if config.sft is not None else [])


def _refuse_existing_runs(config: RunConfig) -> None:
    ck = config.checkpoint
    for name in run_names(config):
        store = CheckpointStore(ck.root, name, ck.storage_options)
        try:
            latest = store.latest_step()
        finally:
            store.close()
        if latest is not None:
            raise ValueError(
                f"run {name!r} already has checkpoints under {ck.root} (latest step {latest}): "
                "continue it with --resume, choose another name, or set "
                "checkpoint.overwrite: true to replace them"
            )


def clear_previous_checkpoints(config: RunConfig) -> None:
    """checkpoint.overwrite on a new run: the earlier run's checkpoints of the same name go."""
    ck = config.checkpoint
    for name in run_names(config):
        store = CheckpointStore(ck.root, name, ck.storage_options)
        try:
            store.remove_all()
        finally:
            store.close()


_CHECKED: list[str] = []  # the inputs a caller checked just before (`checked_inputs`)


def _key(config: RunConfig, resume: bool, resume_step: int | None) -> str:
    return json.dumps([config.model_dump(mode="json"), resume, resume_step], sort_keys=True)


@contextlib.contextmanager
def checked_inputs(
    config: RunConfig, resume: bool = False, resume_step: int | None = None
) -> Iterator[None]:
    """Within it, `preflight` of these very inputs passes at once: `miles train` checked them
    before it started the flow, whose first task checks them for runs started elsewhere (the
    Prefect UI, a deployment)."""
    _CHECKED.append(_key(config, resume or resume_step is not None, resume_step))
    try:
        yield
    finally:
        _CHECKED.pop()


def preflight(config: RunConfig, resume: bool = False, resume_step: int | None = None) -> None:
    """Raises ValueError / FileNotFoundError / OSError for: agent plug-ins that do not import,
    a tracking URI MLflow has no store for, a starting model whose config.json or safetensors
    headers are malformed, truncated or disagree, or that does not fit the machine's memory
    (models/check.py), unreadable or malformed datasets (row number in the message), chat roles
    outside CHAT_ROLES, rows without the label the task scores against, prompts that do not
    fit the context with one call's new tokens (rollout.max_new_tokens; agent.max_tokens in an
    agentic run), a sandbox environment task whose scripted solution cannot fit agent.max_tokens,
    agent.max_turns or the token budget, an agentic task without agent.function, agent.eval_episodes that only
    training tasks could fill (data/held_out.py), SFT data without answers, a missing
    starting model, a run name another live run holds (checkpoint/run_lock.py: RunLocked), an
    unwritable checkpoint root, a new run whose name already has checkpoints (unless
    checkpoint.overwrite), and on resume: no checkpoint (or none at `resume_step`), a
    checkpoint at or past train.num_steps, one whose model config differs from the configured
    model, or an async rollout buffer the config cannot continue (checkpoint/resume_checks.py)."""
    resume = resume or resume_step is not None
    if _CHECKED and _CHECKED[-1] == _key(config, resume, resume_step):
        return
    _check_all(config, resume, resume_step)


def _check_all(config: RunConfig, resume: bool, resume_step: int | None) -> None:
    _check_plugins(config)
    _check_cluster(config)
    if config.diffusion is not None:
        from miles_core.diffusion.preflight import check_image_run

        check_tracking_uri(resolve_tracking_uri(config.tracking.tracking_uri), "the tracking URI")
        check_image_run(config, resume)
        _check_store(config, resume, resume_step, None)
        return
    if config.sft is not None and config.sft.reuse and not resume:  # RL starts from it
        _check_reused(config.sft.reuse, config.checkpoint.storage_options)
        config = config.with_model_path(config.sft.reuse)
    explicit = config.tracking.tracking_uri
    check_tracking_uri(
        resolve_tracking_uri(explicit),
        "tracking.tracking_uri" if explicit else "the tracking URI ($MLFLOW_TRACKING_URI)",
    )
    model_config = _model_config(config)
    _check_model(config, model_config)
    context = int(model_config.get("max_position_embeddings") or 0)
    tok = _tokenizer(config)
    data = config.data
    rows = rl_examples(config)
    where = data.path or f"task {data.task!r}"
    if getattr(TASKS.get(data.task), "needs_label", False):
        missing = next((i for i, ex in enumerate(rows, start=1) if ex.label is None), None)
        if missing:
            raise ValueError(
                f"{where}: row {missing} has no 'label' (task {data.task!r} scores against it)"
            )
    _check_roles(rows, where)
    _check_adapters(config, rows, where)
    if config.train.distill is not None:
        from miles_core.distill.teachers import check_teachers

        check_teachers(config.train.distill, model_config, tok, rows)
    if tok is not None and context:
        _check_lengths(rows, tok, _call_budget(config), context, where, "rl")
    if config.agent.function is not None and hasattr(TASKS.get(data.task), "environment_of"):
        _check_episode_budget(config, TASKS.get(data.task), context)
    if config.agent.function is not None and config.agent.eval_episodes:
        from miles_core.data.held_out import EVAL_SEED_OFFSET, held_out, trained_on

        # the evaluation tasks exist and none is a training task (refused here if too few)
        held_out(
            TASKS.get(data.task),
            config.agent.eval_episodes,
            data.seed + EVAL_SEED_OFFSET,
            trained_on(config, rows),
            "agent.eval_episodes",
        )
    if config.sft is not None:
        sft = config.sft
        sft_rows = sft_examples(sft)
        sft_where = sft.path or f"task {sft.task!r}"
        sft_task = TASKS.get(sft.task)
        scripted = hasattr(sft_task, "demonstration")  # builds its own samples
        if scripted and tok is not None:
            from miles_core.tito.check import check_family_matches  # it renders with agent.family

            check_family_matches(config.agent.family, tok)
        missing = next((i for i, ex in enumerate(sft_rows, start=1) if ex.answer is None), None)
        if missing and not scripted:
            raise ValueError(
                f"{sft_where}: row {missing} has no 'answer' (SFT needs reference answers)"
            )
        _check_roles(sft_rows, sft_where)
        if tok is not None and context:
            _check_lengths(sft_rows, tok, ("", 0), context, sft_where, "sft")

    _check_store(config, resume, resume_step, model_config)


def _check_store(
    config: RunConfig, resume: bool, resume_step: int | None, model_config: dict | None
) -> None:
    """The checkpoint root is writable, the run's names are free, and on resume the checkpoint
    exists, is short of train.num_steps and fits the model (`model_config`; None: an image
    run's, checked by its modality)."""
    store = CheckpointStore(config.checkpoint.root, config.name, config.checkpoint.storage_options)
    try:
        store.check_writable()
        _check_unclaimed(config, run_names(config))
        if not resume and not config.checkpoint.overwrite:
            _refuse_existing_runs(config)
        if resume:
            latest = store.latest_step()
            if latest is None:
                raise FileNotFoundError(
                    f"--resume: run {config.name!r} has no checkpoint under {config.checkpoint.root}"
                )
            if resume_step is not None and resume_step != latest:
                saved = store.steps()
                if resume_step not in saved:
                    raise FileNotFoundError(
                        f"--resume-step {resume_step}: run {config.name!r} has no checkpoint of "
                        f"step {resume_step} under {config.checkpoint.root} (saved steps: "
                        f"{', '.join(map(str, saved)) or 'none'})"
                    )
                latest = resume_step
            if latest + 1 >= config.train.num_steps:
                raise ValueError(
                    f"--resume: run {config.name!r} is already at step {latest + 1} of "
                    f"{config.train.num_steps}; raise train.num_steps to continue it"
                )
            if model_config is None:  # an image run's
                if store.read_state(latest).get("modality") != "image":
                    raise ValueError(
                        f"--resume: checkpoint step {latest} of run {config.name!r} is not an "
                        "image run's"
                    )
                return
            check_checkpoint_matches(
                architecture_of(model_config), store.uri(latest), config.checkpoint.storage_options
            )
            check_buffer_resumable(store.read_json(latest, BUFFER_FILE), config, latest)
            check_backend_resumable(store.read_state(latest).get("config"), config, latest)
    finally:
        store.close()
