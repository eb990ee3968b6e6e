"""Run configurations several test modules share."""

from __future__ import annotations

from miles_core.config import load_config


def tiny_say_a(tmp_path, *sets):
    """A tiny say_a run: 4 prompts × 4 samples of 8 tokens a step, one optimizer step of two
    micro-batches; `sets` override or add settings."""
    return load_config(
        None,
        [
            "model.preset=tiny",
            "data.task=say_a",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.lr=3e-3",
            f"checkpoint.root={tmp_path / 'ckpt'}",
            *sets,
        ],
    )


# an agentic run's groups: B prompts × n episodes of the terminal suite, in sandboxes, through
# the session server (a random tiny model: most episodes end at their first reply)
AGENTIC = [
    "data.task=terminal",
    "data.num_prompts=64",
    "agent.function=miles_core.envs.sandbox_agent:run_agent",
    "agent.max_turns=3",
    "agent.concurrency=4",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.loss_options.loss_agg=rollout_mean_token_mean",
]
