"""Checks that run before anything starts: a bad config, dataset or checkpoint fails here,
with a message that says what to fix, not minutes later inside a flow."""

from __future__ import annotations

from miles_core.config import RunConfig
from miles_core.data import load_examples
from miles_core.models import architecture_of, build_tokenizer
from miles_core.models.builder import preset_config
from miles_core.storage import CheckpointStore, check_checkpoint_matches, fetch_model_dir


def expected_architecture(config: RunConfig) -> dict:
    if config.model.path:
        return architecture_of(
            fetch_model_dir(config.model.path, config.checkpoint.storage_options)
        )
    tok = build_tokenizer()
    return architecture_of(
        preset_config(config.model.preset, len(tok), tok.pad_token_id, tok.eos_token_id)
    )


def preflight(config: RunConfig, resume: bool = False) -> None:
    """Raises ValueError / FileNotFoundError for: unreadable or malformed datasets (row number in
    the message), SFT data without answers, a missing starting model, and a checkpoint to resume
    whose model config differs from the configured model."""
    load_examples(
        config.data.task,
        config.data.path,
        config.data.num_prompts,
        config.data.seed,
        config.data.storage_options,
    )
    if config.sft is not None:
        sft = config.sft
        rows = load_examples(sft.task, sft.path, sft.num_examples, sft.seed, sft.storage_options)
        missing = [i + 1 for i, ex in enumerate(rows) if ex.answer is None]
        if missing:
            where = sft.path or f"task {sft.task!r}"
            raise ValueError(
                f"{where}: row {missing[0]} has no 'answer' (SFT needs reference answers)"
            )
    arch = expected_architecture(config)
    if resume:
        store = CheckpointStore(
            config.checkpoint.root, config.name, config.checkpoint.storage_options
        )
        latest = store.latest_step()
        store.close()
        if latest is None:
            raise FileNotFoundError(
                f"--resume: run {config.name!r} has no checkpoint under {config.checkpoint.root}"
            )
        check_checkpoint_matches(arch, store.uri(latest), config.checkpoint.storage_options)
