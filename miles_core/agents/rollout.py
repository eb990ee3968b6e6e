"""The default agentic rollout function: B prompts × n episodes per step, each episode run by the
generate function (default: the agent function in a session on the session server), grouped per
prompt for GRPO.

The environment sets each episode's reward (the agent returns it); all leaves of an episode
share it and its rollout id. An episode that fails (the agent raised, timed out, or set no
reward) stays in the batch with reward 0 and a zero loss mask, so it trains nothing and the
batch keeps its shape; it is counted in `rollout/failed_episodes`.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from miles_core.agents.layers import (
    GenerateInput,
    GenerateOutput,
    RolloutInput,
    RolloutOutput,
    RolloutSetup,
)
from miles_core.rollout.rollout_fn import rollout_metrics
from miles_core.types import Sample, SampleGroup, Status


class AgenticRollout:
    def __init__(self, setup: RolloutSetup):
        self.setup = setup
        self.config = setup.config
        self.source = setup.source
        self._seen: dict[str, float] = {}  # session-server totals at the last step

    async def __call__(self, inp: RolloutInput) -> RolloutOutput:
        r, agent = self.config.rollout, self.config.agent
        prompts = self.source.next_batch(r.prompts_per_step)
        limit = asyncio.Semaphore(agent.concurrency)
        t0 = time.perf_counter()

        async def episode(g: int, k: int, example) -> GenerateOutput:
            messages = (
                [{"role": "user", "content": example.prompt}]
                if isinstance(example.prompt, str)
                else list(example.prompt)
            )
            gen_in = GenerateInput(
                prompt=messages,
                metadata={"task": example.label, "max_turns": agent.max_turns},
                request_kwargs={
                    "max_tokens": agent.max_tokens,
                    "temperature": r.temperature,
                    "seed": (r.seed + self.config.seed) * 1_000_003
                    + inp.step * 10_007
                    + g * r.n_samples_per_prompt
                    + k,
                },
                rollout_id=f"s{inp.step}-g{g}-{k}",
                session_url=self.setup.session_url,
            )
            async with limit:
                try:
                    return await self.setup.generate(gen_in)
                except Exception as e:  # noqa: BLE001  (one episode's failure, not the step's)
                    return GenerateOutput([], error=f"generate function failed: {e!r}")

        jobs = [
            episode(g, k, ex)
            for g, (_, ex) in enumerate(prompts)
            for k in range(r.n_samples_per_prompt)
        ]
        outputs = await asyncio.gather(*jobs)
        seconds = time.perf_counter() - t0
        groups, failed, episode_metrics = [], 0, []
        for g, (data_index, _) in enumerate(prompts):
            samples: list[Sample] = []
            for k in range(r.n_samples_per_prompt):
                out = outputs[g * r.n_samples_per_prompt + k]
                ok = out.error is None and out.reward is not None and out.samples
                failed += not ok
                episode_metrics.append(out.metrics)
                for s in out.samples or [_empty(out, f"s{inp.step}-g{g}-{k}")]:
                    s.group_index, s.index = g, len(samples)
                    s.reward = float(out.reward) if ok else 0.0
                    s.metadata.update(data_index=data_index, episode=k)
                    if not ok:
                        s.status = Status.FAILED
                        s.loss_mask = [0] * s.response_length
                    samples.append(s)
            groups.append(SampleGroup(group_index=g, samples=samples))
        result = RolloutOutput(groups)
        all_samples = [s for grp in groups for s in grp.samples]
        rewards = [float(o.reward or 0.0) if o.error is None else 0.0 for o in outputs]
        result.metrics = rollout_metrics(all_samples, seconds) | {
            "rollout/success_rate": statistics.fmean(rewards),
            "rollout/failed_episodes": float(failed),
            "rollout/samples_per_episode": len(all_samples) / len(outputs),
        }
        for key in sorted({k for m in episode_metrics for k in m}):
            vals = [m[key] for m in episode_metrics if key in m]
            result.metrics[f"agent/{key}_mean"] = statistics.fmean(vals)
        result.metrics |= await self._session_counters()
        return result

    async def _session_counters(self) -> dict[str, float]:
        """This step's TITO mismatches and branches, from the session server's totals."""
        import httpx

        async with httpx.AsyncClient(base_url=self.setup.session_url, timeout=30) as http:
            totals = (await http.get("/metrics")).json()
        out = {}
        for key, name in (
            ("mismatched_tokens", "tito_mismatched_tokens"),
            ("branches", "branches"),
        ):
            now = float(totals.get(key, 0))
            out[f"rollout/session/{name}"] = now - self._seen.get(key, 0.0)
            self._seen[key] = now
        return out


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
