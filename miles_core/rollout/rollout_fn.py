"""The default rollout function: prompts → n samples each → rewards → SampleGroups.

It renders each prompt once with the chat template, asks the engine for token ids and log-probs,
and keeps the engine's ids as they are (the response text is decoded only for the reward).
"""

from __future__ import annotations

import hashlib
import time

from miles_core.config import RolloutConfig
from miles_core.data.dataset import to_messages
from miles_core.data.tasks import Example, Task
from miles_core.engines.protocol import RolloutEngine
from miles_core.engines.wire import GenerateRequest, GenerateResponse, SamplingParams
from miles_core.rollout.scoring import safe_score
from miles_core.token_fields import requested
from miles_core.types import FINISH_REASON_TO_STATUS, Sample, SampleGroup, Status


class RolloutResult:
    """One rollout batch. A plain class on purpose: orchestrators that walk dataclasses and lists
    (Prefect's task-input tracking) pass it by reference instead of visiting every token id."""

    def __init__(self, groups: list[SampleGroup], metrics: dict[str, float] | None = None):
        self.groups = groups
        self.metrics = metrics or {}

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


def encode_prompt(tokenizer, prompt) -> list[int]:
    text = tokenizer.apply_chat_template(
        to_messages(prompt), add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def request_seed(base: int, step: int, index: int) -> int:
    """A sampling seed per (run seed, step, sample): the same tokens whatever the batching."""
    return ((base * 1_000_003 + step) * 1_000_033 + index) % (1 << 62)


def continuation_seed(seed: int | None, generated: int) -> int | None:
    """The sampling seed of a request continued after `generated` tokens (a pause-abort): a
    deterministic function of (seed, generated), so a re-issued continuation draws the same
    tokens, but a fresh stream: the continuation does not redraw the uniforms of the original's
    first tokens. A hash, not seed + generated: request seeds of one step are consecutive, and
    seed + k would replay sibling k's stream."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 62)


def sampling_params(cfg: RolloutConfig, tokenizer) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop_token_ids=[tokenizer.eos_token_id],
        no_stop_trim=True,
    )


def adapter_of(ex: Example, cfg: RolloutConfig) -> str | None:
    """The LoRA adapter a prompt's requests name: its own (a multi-LoRA run's data), else the
    run's (rollout.adapter; None without LoRA)."""
    return ex.adapter or cfg.adapter


def group_requests(
    ids: list[int],
    sp: SamplingParams,
    cfg: RolloutConfig,
    step: int,
    g: int,
    seeded: bool,
    adapter: str | None = None,
) -> list[GenerateRequest]:
    """The n requests of group g of a step (rid `step-g-k`; per-request seeds unless the engine
    samples a whole batch from one generator), naming LoRA adapter `adapter`."""
    n = cfg.n_samples_per_prompt
    return [
        GenerateRequest(
            input_ids=ids,
            sampling_params=sp.model_copy(
                update={"sampling_seed": request_seed(cfg.seed, step, g * n + k)}
            )
            if seeded
            else sp,
            rid=f"{step}-{g}-{k}",
            return_fields=requested(cfg.token_fields),
            lora_path=adapter,
        )
        for k in range(n)
    ]


def build_group(
    task: Task,
    step: int,
    g: int,
    n: int,
    data_index: int,
    ex: Example,
    ids: list[int],
    responses: list[GenerateResponse],
    versions: list[list[int]] | None = None,
    reward_timeout_s: float = 30.0,
    adapter: str | None = None,
) -> SampleGroup:
    """Scores the responses of one prompt; `versions[k]` are the weight versions of sample k's
    generation calls (default: the version its single response reports). A response whose
    reward function fails (raises, times out, non-finite) becomes a FAILED sample: reward 0, a
    zero loss mask, the reason in its metadata."""
    samples = []
    for k, resp in enumerate(responses):
        out = resp.output_ids
        status = FINISH_REASON_TO_STATUS[resp.meta_info.finish_reason.type]
        score, error = safe_score(task, resp.text, ex.label, reward_timeout_s)
        if resp.field_error:  # its per-token record does not fit: nothing of it is trained
            error = f"the engine's per-token record was refused: {resp.field_error}"
        sample = Sample(
            group_index=g,
            index=g * n + k,
            rollout_id=f"s{step}-g{g}-{k}",
            prompt=ex.prompt,
            tokens=ids + out,
            response_length=len(out),
            loss_mask=[0 if error else 1] * len(out),
            rollout_log_probs=resp.output_log_probs,
            weight_versions=versions[k] if versions else [resp.meta_info.version],
            reward=float(score.reward),
            status=Status.FAILED if error else status,
            label=ex.label,
            response=resp.text,
            token_fields=dict(resp.token_fields),
            metadata={
                "data_index": data_index,
                "metrics": score.metrics,
                "cached_tokens": resp.meta_info.cached_tokens,
            }
            | ({"error": error} if error else {})
            | ({"adapter": adapter} if adapter else {})
            | ({"row": dict(ex.fields)} if ex.fields else {}),
        )
        sample.validate()
        samples.append(sample)
    return SampleGroup(group_index=g, samples=samples)


def generate_groups(
    engine: RolloutEngine,
    tokenizer,
    task: Task,
    prompts: list[tuple[int, Example]],
    cfg: RolloutConfig,
    step: int,
) -> RolloutResult:
    t0 = time.perf_counter()
    sp = sampling_params(cfg, tokenizer)
    n = cfg.n_samples_per_prompt
    encoded = [encode_prompt(tokenizer, ex.prompt) for _, ex in prompts]
    seeded = engine.per_request_seeds  # continuous batching: seed per request, not per batch
    adapters = [adapter_of(ex, cfg) for _, ex in prompts]
    requests = [
        r
        for g, ids in enumerate(encoded)
        for r in group_requests(ids, sp, cfg, step, g, seeded, adapters[g])
    ]
    load_before = engine.load_counters()
    responses = engine.generate(requests)
    gen_seconds = time.perf_counter() - t0
    load = engine_load(load_before, engine.load_counters())
    groups = [
        build_group(
            task,
            step,
            g,
            n,
            data_index,
            ex,
            ids,
            responses[g * n : (g + 1) * n],
            reward_timeout_s=cfg.reward_timeout_s,
            adapter=adapters[g],
        )
        for g, ((data_index, ex), ids) in enumerate(zip(prompts, encoded, strict=True))
    ]
    result = RolloutResult(groups)
    result.metrics = rollout_metrics(result.samples, gen_seconds) | load
    return result


def engine_load(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean active requests and queue depth per engine step between two `load_counters`."""
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    if steps <= 0:
        return {}
    return {
        "rollout/engine_active_requests": (after["running_sum"] - before["running_sum"]) / steps,
        "rollout/engine_queue_depth": (after["waiting_sum"] - before["waiting_sum"]) / steps,
        "rollout/engine_steps": steps,
    }


def rollout_metrics(samples: list[Sample], seconds: float) -> dict[str, float]:
    import statistics

    rewards = [float(s.reward or 0.0) for s in samples]
    lengths = [s.response_length for s in samples]
    versions = [v for s in samples for v in s.weight_versions]
    prompt_tokens = sum(s.prompt_length for s in samples)
    cached = sum(s.metadata.get("cached_tokens", 0) for s in samples)
    metrics = {
        "rollout/prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples)
        / len(samples),
        "rollout/failed_samples": float(sum(s.status == Status.FAILED for s in samples)),
        "rollout/tokens_per_s": sum(lengths) / seconds if seconds > 0 else 0.0,
        "rollout/weight_version/mean": statistics.fmean(versions),
        "rollout/weight_version/min": float(min(versions)),
        "rollout/weight_version/max": float(max(versions)),
        "perf/rollout_generate_time_s": seconds,
    }
    adapters = {s.metadata.get("adapter") for s in samples}
    if len(adapters) > 1:  # a multi-LoRA run: each adapter's reward
        for name in sorted(a for a in adapters if a):
            mine = [float(s.reward or 0.0) for s in samples if s.metadata.get("adapter") == name]
            metrics[f"rollout/reward_mean/{name}"] = statistics.fmean(mine)
    extra_keys = {k for s in samples for k in s.metadata.get("metrics", {})}
    for key in sorted(extra_keys):
        vals = [s.metadata["metrics"][key] for s in samples if key in s.metadata.get("metrics", {})]
        metrics[f"rollout/{key}"] = statistics.fmean(vals)
    return metrics
