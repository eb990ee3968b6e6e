"""The embedded engine: one batched generate call at a time, in the caller's thread.

Each distinct prompt is prefilled once; every decode step then feeds one token per row, samples
all rows at once, and records the log-prob of each sampled token. Output ids are returned as
generated; nothing is re-tokenized. The model runs through a `BatchForward` (batch_forward.py):
the model family's fast forward where it has one, the model's own modules otherwise
(`fast=False` forces those); with `true_on_policy`, the family's invariant forward and the
trainer's log-softmax (`true_on_policy/`), so its log-probs are the trainer's bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from miles_core.engines.cpu.adapter_calls import AdapterCalls, check_adapter, rows_using
from miles_core.engines.cpu.batch_forward import batch_forward_for
from miles_core.engines.cpu.loading import PackedWeightsDiffer, tensors_checksum
from miles_core.engines.cpu.prompt_logprobs import PromptScorer, check_scoring
from miles_core.engines.cpu.sampler import sample_next
from miles_core.engines.cpu.slot_forward import SlotBatchForward
from miles_core.engines.cpu.threads import StepThreads
from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.wire import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    validate_request,
)
from miles_core.lora.served import served_adapters
from miles_core.precision.plan import QuantPlan
from miles_core.precision.served import ServedWeights
from miles_core.true_on_policy import token_versions
from miles_core.true_on_policy.runner import invariant_runner
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS


class EmbeddedEngine(AdapterCalls):
    weight_routes = IN_PROCESS_ROUTES
    per_request_seeds = False  # one batch, one shared generator (`generator`)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        seed: int = 0,
        max_batch_size: int = 512,
        adapt_threads: bool = False,
        fast: bool = True,
        true_on_policy: bool = False,
        precision: dict | None = None,
        lora: dict | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(model.config.max_position_embeddings)
        self.pad_id = int(tokenizer.pad_token_id)
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._version = 0
        self._lock = threading.Lock()
        plan = QuantPlan.from_spec(precision, int(model.config.num_hidden_layers))
        # LoRA: adapters served per request, unmerged (lora/served.py)
        self.adapters = served_adapters(self.model, lora)
        self.weights = ServedWeights(dict(model.named_parameters()), plan, self.adapters)
        self.true_on_policy = true_on_policy
        if true_on_policy:  # the trainer's own forward and log-softmax (true_on_policy/)
            runner = invariant_runner(self.model, slots=0)
            self.forward = SlotBatchForward(runner)
            self.scorer = PromptScorer(self.model, runner.inv)
        else:
            self.forward = batch_forward_for(self.model, self.pad_id, fast=fast)
            self.scorer = PromptScorer(self.model)
        if self.adapters is not None:
            self.forward.use_adapters(self.adapters)
        self._load = {"steps": 0.0, "running_sum": 0.0, "waiting_sum": 0.0}
        # per-step thread counts (threads.py), when no trainer computes beside `generate`
        cpu = next(model.parameters()).device.type == "cpu"
        self.step_threads = StepThreads(model.config, adapt_threads and cpu)

    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def _token_versions(self, req: GenerateRequest, n: int) -> dict[str, list[int]]:
        """The `token_versions` field, when asked or in true on-policy mode: weights change
        only between calls here."""
        if not token_versions.reported(req.return_fields, self.true_on_policy):
            return {}
        return {TOKEN_VERSIONS.wire_key: [self._version] * n}

    def load_counters(self) -> dict[str, float]:
        """Cumulative step and load counters (see `RolloutEngine.load_counters`)."""
        return dict(self._load)

    def pause(
        self, mode: str = "abort"
    ) -> None:  # single-call engine: nothing in flight between calls
        self._lock.acquire()

    def resume(self) -> None:
        self._lock.release()

    # ---------------------------------------------------------------- weights
    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        try:
            return self.weights.load(named_tensors)
        finally:  # also after a refused load (nothing copied): repacking is only wasted time
            self.forward.invalidate()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return self.weights.tensors()

    def weights_checksum(self, scope: str = "all") -> str:
        """sha256 of the weights that generate (`scope`: all, base or adapters): whatever the
        forward derived from the model's parameters (the runner's packed copies) is first
        checked bitwise against them."""
        # no lock: a paused engine holds it (pause → push → check)
        stale = self.forward.stale() + self.weights.stale()
        if stale:
            raise PackedWeightsDiffer(
                f"the engine forward's weight copies differ from its tensors: {stale[:5]}"
            )
        return tensors_checksum(self.weights.tensors(scope))

    def close(self) -> None:
        """Nothing to stop: it runs only inside `generate`."""

    # ---------------------------------------------------------------- generation
    def validate(self, req: GenerateRequest) -> None:
        validate_request(req, self.vocab_size, self.max_context)
        check_scoring(req)
        check_adapter(self.adapters, req)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        for r in requests:
            self.validate(r)
        out: list[GenerateResponse] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(requests), self.max_batch_size):
                out.extend(self._generate_batch(requests[start : start + self.max_batch_size]))
        return out

    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        bsz = len(requests)
        prompt_lens = [len(r.input_ids) for r in requests]
        # each distinct prompt is prefilled once (a GRPO group's n samples share one); with
        # adapters, once per (prompt, adapter)
        distinct: dict[tuple, int] = {}
        row_prompt = [
            distinct.setdefault((tuple(r.input_ids), r.lora_path), len(distinct)) for r in requests
        ]
        prompts = [list(p) for p, _ in distinct]
        prompt_adapters = [a for _, a in distinct]
        row_adapters = [r.lora_path for r in requests]
        sps = [r.sampling_params for r in requests]
        temperature = torch.tensor([sp.effective_temperature() for sp in sps], dtype=torch.float32)
        top_k = torch.tensor([sp.effective_top_k() for sp in sps], dtype=torch.long)
        top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32)
        limit_list = [sp.max_new_tokens for sp in sps]
        stop_sets = [set(sp.stop_token_ids or []) for sp in sps]
        max_steps = max(limit_list, default=0)

        outputs: list[list[int]] = [[] for _ in range(bsz)]
        logps: list[list[float]] = [[] for _ in range(bsz)]
        finish: list[FinishReason | None] = [None] * bsz
        for i in range(bsz):
            if limit_list[i] == 0:
                finish[i] = FinishReason(type="length", length=0)

        truncate = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
        length = max(n + k for n, k in zip(prompt_lens, limit_list, strict=True)) if bsz else 0
        tokens: torch.Tensor | None = None
        for _ in range(max_steps):
            fed = bsz if tokens is not None else sum(len(p) for p in prompts)
            with self.step_threads.around(fed):
                if tokens is None:
                    with rows_using(self.adapters, prompt_adapters):
                        logits = self.forward.prefill(prompts, row_prompt, length)
                else:
                    with rows_using(self.adapters, row_adapters):
                        logits = self.forward.decode(tokens)
                uniforms = torch.rand(bsz, generator=self.generator, dtype=torch.float64)
                tokens, token_lp = sample_next(
                    logits, temperature, top_k, top_p, uniforms, truncate, self.true_on_policy
                )
            self._load["steps"] += 1
            self._load["running_sum"] += sum(f is None for f in finish)
            tok_list, lp_list = tokens.tolist(), token_lp.tolist()
            for i in range(bsz):
                if finish[i] is not None:
                    continue
                outputs[i].append(tok_list[i])
                logps[i].append(lp_list[i])
                if tok_list[i] in stop_sets[i]:
                    finish[i] = FinishReason(type="stop", matched=tok_list[i])
                elif len(outputs[i]) >= limit_list[i]:
                    finish[i] = FinishReason(type="length", length=len(outputs[i]))
            if all(f is not None for f in finish):
                break

        version = str(self._version)
        responses = []
        for i, r in enumerate(requests):
            responses.append(
                GenerateResponse(
                    text=self.tokenizer.decode(outputs[i], skip_special_tokens=True),
                    output_ids=outputs[i],
                    meta_info=MetaInfo(
                        id=r.rid,
                        finish_reason=finish[i],
                        prompt_tokens=prompt_lens[i],
                        completion_tokens=len(outputs[i]),
                        cached_tokens=0,
                        weight_version=version,
                        output_token_logprobs=[
                            (lp, t, None) for lp, t in zip(logps[i], outputs[i], strict=True)
                        ],
                        **self._token_versions(r, len(outputs[i])),
                        **self.scorer.meta(r),
                    ),
                )
            )
        return responses
