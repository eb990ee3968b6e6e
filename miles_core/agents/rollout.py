"""The default agentic rollout function: B prompts × n episodes per step, each episode run by the
generate function (default: the agent function in a session on the session server), grouped per
prompt for GRPO.

The environment sets each episode's reward (the agent returns it), then the reward hooks, if
configured (`agents/rewards.py`); all leaves of an episode share it and its rollout id. An
episode that fails (the agent raised or timed out, a reward hook failed, or nothing set a
reward) stays in the batch with reward 0 and a zero loss mask, so it trains nothing and the
batch keeps its shape; it is counted in `rollout/failed_episodes`, its reason logged and kept in
its samples' metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import statistics
import time
from collections import Counter

from miles_core.agents.in_flight import InFlight
from miles_core.agents.layers import (
    GenerateInput,
    GenerateOutput,
    RolloutInput,
    RolloutOutput,
    RolloutSetup,
)
from miles_core.data.tasks import Example
from miles_core.rollout.rollout_fn import rollout_metrics
from miles_core.types import Sample, SampleGroup, Status

log = logging.getLogger("miles")


class AgenticRollout:
    def __init__(self, setup: RolloutSetup):
        self.setup = setup
        self.config = setup.config
        self.source = setup.source
        self._seen: dict[str, float] = {}  # session-server totals at the last step

    async def _episode(
        self,
        example,
        rollout_id: str,
        seed: int,
        limit: contextlib.AbstractAsyncContextManager,
        routing_key: str | None = None,
    ) -> GenerateOutput:
        """One agent episode through the generate function; its failure is the episode's.
        Episodes with the same `routing_key` share an engine behind the router."""
        r, agent = self.config.rollout, self.config.agent
        messages = (
            [{"role": "user", "content": example.prompt}]
            if isinstance(example.prompt, str)
            else list(example.prompt)
        )
        gen_in = GenerateInput(
            prompt=messages,
            metadata={"task": example.label, "max_turns": agent.max_turns}
            | self.setup.metadata
            | ({"command": list(agent.command)} if agent.command else {}),
            request_kwargs={
                "max_tokens": agent.max_tokens,
                "temperature": r.temperature,
                "seed": seed,
            },
            rollout_id=rollout_id,
            session_url=self.setup.session_url,
            api_key=self.setup.api_key,
            routing_key=routing_key,
        )
        async with limit:
            t0 = time.perf_counter()  # from its in-flight slot, not its wait for one
            try:
                out = await self.setup.generate(gen_in)
            except Exception as e:  # noqa: BLE001  (one episode's failure, not the step's)
                return GenerateOutput([], error=f"generate function failed: {e!r}")
            # the whole episode (session, agent, trajectory): agent/episode_s_mean
            out.metrics.setdefault("episode_s", time.perf_counter() - t0)
            return out

    def episode_seed(self, step: int, g: int, k: int) -> int:
        """Episode k of group g of step `step`: the same seed in sync and async runs."""
        r = self.config.rollout
        base = (r.seed + self.config.seed) * 1_000_003 + step * 10_007
        return base + g * r.n_samples_per_prompt + k

    def eval_seed(self, i: int) -> int:
        """Evaluation episode i: the same seed at every evaluation, apart from every training
        episode's (those stay below 2**62) and non-negative (sglang-router takes u64 seeds)."""
        r = self.config.rollout
        return EVAL_SEEDS + (r.seed + self.config.seed) * 1_000_003 + i

    async def group(
        self,
        step: int,
        g: int,
        data_index: int,
        example,
        limit: contextlib.AbstractAsyncContextManager,
    ) -> SampleGroup:
        """Group g of step `step`: its prompt's n episodes (each under `limit`, the episodes in
        flight), the reward hooks, the episodes' leaves as one SampleGroup (a failed episode:
        reward 0, zero loss mask, FAILED; each episode's outcome on its first leaf)."""
        n = self.config.rollout.n_samples_per_prompt
        key = f"s{step}-g{g}" if self.config.agent.routing == "group" else None
        outputs = await asyncio.gather(
            *(
                self._episode(
                    example, f"s{step}-g{g}-{k}", self.episode_seed(step, g, k), limit, key
                )
                for k in range(n)
            )
        )
        failed_before = [o.error is not None for o in outputs]
        await self._rewards(outputs, [example.label] * n, n)
        samples: list[Sample] = []
        for k, out in enumerate(outputs):
            ok = _succeeded(out)
            leaves = out.samples or [_empty(out, f"s{step}-g{g}-{k}")]
            for leaf, s in enumerate(leaves):
                s.group_index, s.index = g, len(samples)
                s.reward = float(out.reward) if ok else 0.0
                s.label = example.label
                s.metadata.update(data_index=data_index, episode=k)
                if leaf == 0:  # what the step's episode metrics read (also after a resume)
                    hook_failed = out.error is not None and not failed_before[k]
                    s.metadata[EPISODE] = _summary(out, ok) | {"hook_failed": hook_failed}
                if not ok:
                    s.status = Status.FAILED
                    s.loss_mask = [0] * s.response_length
                    s.metadata.setdefault("error", failure_reason(out))
                samples.append(s)
        return SampleGroup(group_index=g, samples=samples)

    async def __call__(self, inp: RolloutInput) -> RolloutOutput:
        r = self.config.rollout
        prompts = self.source.next_batch(r.prompts_per_step)
        limit = InFlight(self.config.agent.concurrency)  # in this call's event loop
        t0 = time.perf_counter()
        groups = await asyncio.gather(
            *(self.group(inp.step, g, i, ex, limit) for g, (i, ex) in enumerate(prompts))
        )
        seconds = time.perf_counter() - t0
        result = RolloutOutput(list(groups))
        result.metrics = rollout_metrics([s for grp in groups for s in grp.samples], seconds)
        result.metrics |= step_metrics(result.groups, inp.step) | limit.metrics()
        result.metrics |= await asyncio.to_thread(self.session_counters)
        return result

    async def evaluate(self, examples: list) -> dict[str, float]:
        """`agent.eval_samples` episodes per example at fixed seeds (the same every time: only
        the policy changes between two evaluations; sample j of example i at seed i + j·len, so
        sample 0 is a 1-sample evaluation's); `eval/success_rate` and friends over all of them,
        nothing trained."""
        examples = [ex for _ in range(self.config.agent.eval_samples) for ex in examples]
        limit = asyncio.Semaphore(self.config.agent.concurrency)
        t0 = time.perf_counter()
        outputs = await asyncio.gather(
            *(
                self._episode(ex, f"eval-{i}", self.eval_seed(i), limit)
                for i, ex in enumerate(examples)
            )
        )
        hook_failures = await self._rewards(
            outputs, [ex.label for ex in examples], 1, per_group=False
        )
        metrics = episode_metrics("eval", examples, outputs)
        metrics["eval/reward_hook_failures"] = float(hook_failures)
        failed = [failure_reason(o) for o in outputs if not _succeeded(o)]
        log_failures("evaluation", failed)
        metrics["eval/failed_episodes"] = float(len(failed))
        metrics["eval/time_s"] = time.perf_counter() - t0
        await asyncio.to_thread(self.session_counters)  # eval sessions: not the next step's
        return metrics

    async def _rewards(self, outputs, tasks, n: int, per_group: bool = True) -> int:
        """The reward hooks, if any, on top of the environment's rewards (in place)."""
        hooks = self.setup.rewards
        if hooks is None:
            return 0
        if not per_group:  # an evaluation scores episodes alone, not against their siblings
            hooks = dataclasses.replace(hooks, per_group=None)
        return await hooks.apply(outputs, tasks, n)

    def session_counters(self) -> dict[str, float]:
        """This step's TITO divergences and branches, from the session server's totals:
        `tito_token_edits` (single-token edits between the engine's replies and the harness's
        re-rendered ones), `tito_diverged_replies`, and where a step has some,
        `tito_first_divergence_mean` (mean position in a reply where it first differs); the
        model calls' `prefix_cache_hit_rate` (prompt ids the engines found cached) against
        `session_prefix_rate` (prompt ids that repeat the session's previous turn: what a
        cache keeping each session on its engine can reuse; prompts shared across sessions,
        e.g. a GRPO group's, add hits beyond it)."""
        import httpx

        from miles_core.processes.auth import bearer

        headers = bearer(self.setup.api_key)
        with httpx.Client(base_url=self.setup.session_url, timeout=30, headers=headers) as http:
            totals = http.get("/metrics").json()
        step = {}
        for key in (
            "tito_token_edits",
            "tito_diverged_replies",
            "tito_first_divergence_sum",
            "prompt_ids",
            "session_prefix_ids",
            "cached_prompt_ids",
        ):
            now = float(totals.get(key, 0))
            step[key] = now - self._seen.get(key, 0.0)
            self._seen[key] = now
        now = float(totals.get("branches", 0))
        out = {
            "rollout/session/tito_token_edits": step["tito_token_edits"],
            "rollout/session/tito_diverged_replies": step["tito_diverged_replies"],
            "rollout/session/branches": now - self._seen.get("branches", 0.0),
        }
        self._seen["branches"] = now
        if step["prompt_ids"]:  # the model calls' prompts: found in the engines' prefix caches,
            # and what keeping each session on one engine could find (its earlier turns)
            out["rollout/session/prefix_cache_hit_rate"] = (
                step["cached_prompt_ids"] / step["prompt_ids"]
            )
            out["rollout/session/session_prefix_rate"] = (
                step["session_prefix_ids"] / step["prompt_ids"]
            )
        if step["tito_diverged_replies"]:
            out["rollout/session/tito_first_divergence_mean"] = (
                step["tito_first_divergence_sum"] / step["tito_diverged_replies"]
            )
        return out


EPISODE = "episode_summary"  # a leaf-0 sample's metadata key: its episode's outcome
EVAL_SEEDS = 1 << 62  # evaluation episodes' sampling seeds start here


def _summary(out: GenerateOutput, ok: bool) -> dict:
    return {
        "ok": ok,
        "reward": out.reward,
        "env_reward": out.env_reward,
        "metrics": dict(out.metrics),
        "error": None if ok else failure_reason(out),
    }


def step_metrics(groups: list[SampleGroup], step: int) -> dict[str, float]:
    """The episode metrics of one step's groups (`episode_metrics`, from each episode's
    summary on its first leaf), failed episodes and their reasons (logged), reward-hook
    failures and leaves per episode."""
    examples, outputs, hook_failures = [], [], 0
    for grp in groups:
        for s in grp.samples:
            summary = s.metadata.get(EPISODE)
            if summary is None:
                continue
            hook_failures += bool(summary.get("hook_failed"))
            examples.append(Example(prompt=s.prompt, label=s.label))
            outputs.append(
                GenerateOutput(
                    [s] if summary["ok"] else [],
                    reward=summary["reward"],
                    metrics=summary["metrics"],
                    error=summary["error"],
                    env_reward=summary["env_reward"],
                )
            )
    samples = sum(len(grp.samples) for grp in groups)
    failed = [o.error for o in outputs if o.error is not None]
    log_failures(f"step {step}", failed)
    return episode_metrics("rollout", examples, outputs) | {
        "rollout/failed_episodes": float(len(failed)),
        "rollout/reward_hook_failures": float(hook_failures),
        "rollout/samples_per_episode": samples / max(len(outputs), 1),
    }


def log_failures(where: str, reasons: list[str]) -> None:
    """The three most common reasons episodes failed, with their counts (a warning each)."""
    for reason, count in Counter(reasons).most_common(3):
        log.warning("%s: %d episode(s) failed: %s", where, count, reason[:300])


def _succeeded(out: GenerateOutput) -> bool:
    return bool(out.error is None and out.reward is not None and out.samples)


def failure_reason(out: GenerateOutput) -> str:
    if out.error is not None:
        return out.error
    return "no turns recorded" if not out.samples else "nothing set a reward"


def episode_metrics(prefix: str, examples: list, outputs: list[GenerateOutput]) -> dict:
    """`<prefix>/success_rate`: the mean of the environment's grade (the episode's reward
    where the environment gives none; failed episodes count 0), overall, per task kind
    where the label names one ("kind") and per difficulty level ("level": `level_<n>`);
    `<prefix>/episode_reward_mean`: the reward trained on (after
    the hooks); the agent's own metrics as `agent/<key>_mean`, the mean over the episodes
    that reported the key (failed ones too), and `agent/<key>_episodes`, how many did."""
    rewards = [float(o.reward or 0.0) if _succeeded(o) else 0.0 for o in outputs]
    graded = [
        (o.env_reward if o.env_reward is not None else float(o.reward or 0.0))
        if _succeeded(o)
        else 0.0
        for o in outputs
    ]
    out = {
        f"{prefix}/success_rate": statistics.fmean(graded),
        f"{prefix}/episode_reward_mean": statistics.fmean(rewards),
    }
    kinds: dict[str, list[float]] = {}
    for ex, reward in zip(examples, graded, strict=True):
        label = ex.label if isinstance(ex.label, dict) else {}
        if isinstance(label.get("kind"), str):
            kinds.setdefault(_metric_part(label["kind"]), []).append(reward)
        if isinstance(label.get("level"), int):
            kinds.setdefault(f"level_{label['level']}", []).append(reward)
    for kind, values in sorted(kinds.items()):
        out[f"{prefix}/success_rate/{kind}"] = statistics.fmean(values)
    agent_prefix = "agent" if prefix == "rollout" else f"{prefix}/agent"
    for key in sorted({k for o in outputs for k in o.metrics}):
        values = [o.metrics[key] for o in outputs if key in o.metrics]
        out[f"{agent_prefix}/{key}_mean"] = statistics.fmean(values)
        out[f"{agent_prefix}/{key}_episodes"] = float(len(values))  # what the mean is over
    return out


def _metric_part(name: str) -> str:
    """A task kind as part of a metric name: what MLflow accepts (others become "_")."""
    return re.sub(r"[^A-Za-z0-9_\-. :]", "_", name) or "_"


def _empty(out: GenerateOutput, rollout_id: str) -> Sample:
    """A placeholder for an episode that recorded nothing: one masked token, reward 0."""
    return Sample(
        group_index=0,
        index=0,
        rollout_id=rollout_id,
        prompt="",
        tokens=[0, 0],
        response_length=1,
        loss_mask=[0],
        rollout_log_probs=[0.0],
        weight_versions=[0],
        reward=0.0,
        status=Status.FAILED,
        metadata={"error": out.error},
    )
