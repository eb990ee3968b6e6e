"""Text-task groups for the async producer (a `GroupSource`): a prompt's n completions on the
engine server, scored by the task, with the same rids and sampling seeds as a sync run.

A weight push pauses the engine (`pause_mode`); with `retract` or `in_place` running requests
continue after it, with `abort` each interrupted request is continued from its tokens in a new
generation call (with a sampling seed derived from the request's seed and the tokens so far, and
its declared per-token fields joined). Every sample records the version of each of its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from miles_core.config import RolloutConfig
from miles_core.data.tasks import Task
from miles_core.engines.http import HttpEngine, batches
from miles_core.engines.wire import FinishReason, GenerateRequest, GenerateResponse
from miles_core.rollout.group_source import GroupWork, ProducerState
from miles_core.rollout.rollout_fn import (
    adapter_of,
    build_group,
    continuation_seed,
    encode_prompt,
    group_requests,
    sampling_params,
)
from miles_core.token_fields import join_fields
from miles_core.types import SampleGroup

MAX_CONTINUATIONS = 16


def continuation_request(req: GenerateRequest, out_ids: list[int], rid: str) -> GenerateRequest:
    """`req` continued from its prompt + the `out_ids` generated before a pause-abort: the
    tokens left, and a sampling seed of its own (`continuation_seed`), so the continuation does
    not replay the uniforms its first tokens were drawn with."""
    sp = req.sampling_params
    return req.model_copy(
        update={
            "input_ids": req.input_ids + out_ids,
            "sampling_params": sp.model_copy(
                update={
                    "max_new_tokens": sp.max_new_tokens - len(out_ids),
                    "sampling_seed": continuation_seed(sp.sampling_seed, len(out_ids)),
                }
            ),
            "rid": rid,
        }
    )


class EngineGroups:
    def __init__(self, engine: HttpEngine, tokenizer, task: Task, cfg: RolloutConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.cfg = cfg
        self.n = cfg.n_samples_per_prompt
        self.sp = sampling_params(cfg, tokenizer)
        self._client: httpx.AsyncClient | None = None
        self._state: ProducerState | None = None

    @contextlib.asynccontextmanager
    async def open(self, state: ProducerState) -> AsyncIterator[None]:
        # the engine's own /generate path (HttpEngine.post_generate): one client, one parse,
        # one re-issue policy; up to 1 + max_staleness steps of groups in flight
        async with self.engine.async_client(max_connections=512) as client:
            self._client, self._state = client, state
            try:
                yield
            finally:
                self._client = None

    def step_metrics(self, step: int, groups: list[SampleGroup]) -> dict[str, float]:
        return {}

    async def generate(self, work: GroupWork) -> SampleGroup:
        assert self._client is not None and self._state is not None, "open() first"
        ids = encode_prompt(self.tokenizer, work.example.prompt)
        adapter = adapter_of(work.example, self.cfg)
        requests = group_requests(ids, self.sp, self.cfg, work.step, work.g, True, adapter)
        # few HTTP calls per group (the engine's batch_size; a whole group for our engine server):
        # one call per sample made the client's connection pool hold the GIL against the trainer
        start_version = self._state.version()
        chunks = batches(requests, self.engine.batch_size)
        first = [r for c in await asyncio.gather(*(self._post(c) for c in chunks)) for r in c]
        results = await asyncio.gather(
            *(self._one(r, start_version, f) for r, f in zip(requests, first, strict=True))
        )
        return build_group(
            self.task,
            work.step,
            work.g,
            self.n,
            work.data_index,
            work.example,
            ids,
            [r for r, _ in results],
            [v for _, v in results],
            reward_timeout_s=self.cfg.reward_timeout_s,
            adapter=adapter,
        )

    async def _post(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        assert self._client is not None
        return await self.engine.post_generate(self._client, requests)

    async def _one(
        self, req: GenerateRequest, start_version: int, first: GenerateResponse | None
    ) -> tuple[GenerateResponse, list[int]]:
        """One sample from its first call's response, continued from its own tokens after each
        pause-abort."""
        state = self._state
        assert state is not None
        out_ids: list[int] = []
        logprobs: list[tuple] = []
        fields: dict = {}  # declared per-token fields, joined across calls
        field_error: str | None = None
        versions: list[int] = []
        current, resp = req, first
        for _ in range(MAX_CONTINUATIONS):
            if resp is None:
                start_version = state.version()
                resp = (await self._post([current]))[0]
            last = resp
            # the versions this call may have used, in order without repeats (a call that
            # spanned a push under retract / in_place records both)
            for v in (start_version, resp.meta_info.version):
                if not versions or versions[-1] != v:
                    versions.append(v)
            out_ids += resp.output_ids
            logprobs += resp.meta_info.output_token_logprobs or []
            fields = join_fields(fields, resp.token_fields)
            field_error = field_error or resp.field_error
            reason = resp.meta_info.finish_reason
            left = req.sampling_params.max_new_tokens - len(out_ids)
            interrupted = reason.type == "abort" and reason.message is None and not state.stopping()
            if not interrupted or left <= 0:
                break
            state.counters["continued_requests"] += 1
            resp = None
            current = continuation_request(req, out_ids, f"{req.rid}-c{len(versions)}")
        if len(out_ids) >= req.sampling_params.max_new_tokens and reason.type == "abort":
            reason = FinishReason(type="length", length=len(out_ids))
        meta = last.meta_info.model_copy(
            update={
                "finish_reason": reason,
                "completion_tokens": len(out_ids),
                "prompt_tokens": len(req.input_ids),
                "output_token_logprobs": logprobs,
            }
        )
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        response = GenerateResponse(
            text=text, output_ids=out_ids, meta_info=meta, token_fields=fields
        )
        if field_error:  # a part's record was refused: so is the whole sample's
            response.token_fields, response.field_error = {}, field_error
        return response, versions
