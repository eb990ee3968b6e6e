"""The serving engine: continuous batching over a slot KV cache with prefix reuse.

The scheduler (a thread of its own, the caller's thread inside `generate`, or the process's main
thread; see SCHEDULERS) repeats one step: admit waiting requests into free (or prefix-matching)
slots and prefill their uncached tokens; then decode one token for every running request. Requests
join and leave between steps. Control calls (abort, pause, continue, weight updates, memory
release) take the step lock, so they act between two steps.

Pause modes (SGLang's `/pause_generation`): `abort` finishes every request now (finish_reason
abort, partial output returned); `retract` moves running requests back to the queue (their KV stays
cached, so they resume cheaply, continuing from the tokens they had); `in_place` freezes them with
their KV. New requests queue while paused.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from miles_core.device import resolve_device
from miles_core.engines.cpu.adapter_calls import AdapterCalls, check_adapter, rows_using
from miles_core.engines.cpu.loading import PackedWeightsDiffer, tensors_checksum
from miles_core.engines.cpu.prompt_logprobs import PromptScorer, check_scoring
from miles_core.engines.cpu.sampler import sample_next
from miles_core.engines.cpu.slots import Slot, SlotState, SlotTable
from miles_core.engines.cpu.threads import StepThreads
from miles_core.engines.protocol import IN_PROCESS_ROUTES
from miles_core.engines.wire import (
    EngineRequestError,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    validate_request,
)
from miles_core.lora.served import served_adapters
from miles_core.models.family import serving_runner
from miles_core.models.moe import ROUTES
from miles_core.models.moe import encode as encode_routes
from miles_core.precision.plan import QuantPlan
from miles_core.precision.served import ServedWeights
from miles_core.true_on_policy import token_versions
from miles_core.true_on_policy.runner import invariant_runner
from miles_core.true_on_policy.token_versions import TOKEN_VERSIONS

PAUSE_MODES = ("abort", "retract", "in_place")
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes: [-2**63, 2**64)
# thread: a scheduler thread steps the engine (requests from any thread, streaming handles);
# caller: `generate` steps it on the calling thread (no second OpenMP pool in the process, see
# `run` below); main: the process's main thread runs `run()` (the HTTP server does this)
SCHEDULERS = ("thread", "caller", "main")
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
UNIFORMS_AHEAD = 64  # a seeded request's sampling numbers drawn per op
log = logging.getLogger("miles.engine")


@dataclass(eq=False)  # identity semantics: list/deque membership must not compare fields
class _Request:
    rid: str
    input_ids: list[int]
    req: GenerateRequest
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version of each output token
    slot: Slot | None = None
    kv_len: int = 0
    cached_tokens: int = 0
    finish: FinishReason | None = None
    done: threading.Event = field(default_factory=threading.Event)
    response: GenerateResponse | None = None
    generator: torch.Generator | None = None
    uniforms: list[float] = field(default_factory=list)  # drawn ahead from `generator`, in order
    callbacks: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output


class RequestHandle:
    def __init__(self, r: _Request):
        self._r = r
        self.rid = r.rid

    def done(self) -> bool:
        return self._r.done.is_set()

    def add_done_callback(self, fn) -> None:
        """`fn(response)` runs once the request finishes (at once if it already has); it runs on
        the engine thread, so it must only hand the response over (e.g. call_soon_threadsafe)."""
        with self._r.lock:
            if not self._r.done.is_set():
                self._r.callbacks.append(fn)
                return
        fn(self._r.response)

    def result(self, timeout: float | None = None) -> GenerateResponse:
        if not self._r.done.wait(timeout):
            raise TimeoutError(f"request {self.rid} did not finish within {timeout} s")
        assert self._r.response is not None
        return self._r.response


class ServingEngine(AdapterCalls):
    per_request_seeds = True
    weight_routes = IN_PROCESS_ROUTES  # in-process; behind the HTTP server: the server's

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        seed: int = 0,
        max_running: int = 64,
        cache_slots: int | None = None,
        max_len: int | None = None,
        prefix_cache: bool = True,
        dtype: str = "float32",
        scheduler: str = "thread",
        device: str | torch.device = "cpu",
        adapt_threads: bool | None = None,
        true_on_policy: bool = False,
        precision: dict | None = None,
        lora: dict | None = None,
    ):
        # auto | cpu | cuda: weights, packed copies and the KV cache live there; sampling
        # uniforms are drawn on the CPU either way (the same random stream on every device)
        self.device = resolve_device(device)
        self.model = model.eval().to(self.device)
        self.tokenizer = tokenizer
        self.vocab_size = int(model.config.vocab_size)
        self.max_running = max_running
        slots = cache_slots or 2 * max_running
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(COMPUTE_DTYPES)}")
        self.dtype = dtype
        # with rollout.precision: quantized weights as pushed, parameters their values
        plan = QuantPlan.from_spec(precision, int(model.config.num_hidden_layers))
        self._params = dict(model.named_parameters())
        # LoRA: adapters served per request, unmerged (lora/served.py)
        self.adapters = served_adapters(self.model, lora, self.device)
        self.weights = ServedWeights(self._params, plan, self.adapters)
        self.true_on_policy = true_on_policy
        if true_on_policy:  # the trainer's own forward and log-softmax (true_on_policy/)
            self.runner = invariant_runner(
                model, slots=slots, max_len=max_len, dtype=COMPUTE_DTYPES[dtype]
            )
            self.scorer = PromptScorer(self.model, self.runner.inv)
        else:
            self.runner = serving_runner(
                model, slots=slots, max_len=max_len, dtype=COMPUTE_DTYPES[dtype]
            )
            self.scorer = PromptScorer(self.model)
        if self.adapters is not None:
            if not hasattr(self.runner, "lora"):  # it would run every row on the base model
                raise ValueError(
                    f"{type(self.runner).__name__} adds no LoRA adapter terms (a runner that "
                    "does has a `lora` attribute it reads): this engine cannot serve adapters"
                )
            self.runner.lora = self.adapters
        if self.runner.emulate_bf16:
            log.warning(
                "this CPU has no bf16 GEMMs (oneDNN needs AVX512-BF16/AMX or avx_ne_convert): "
                "bf16 numerics are emulated with fp32 GEMMs, at float32 speed"
            )
        self.max_context = self.runner.max_len
        # min_match beyond any context length turns prefix reuse off (for side-by-side benchmarks)
        self.table = SlotTable(slots, min_match=1 if prefix_cache else 1 << 30)
        self.generator = torch.Generator().manual_seed(seed)
        self._version = 0
        self._waiting: deque[_Request] = deque()
        self._inbox: deque[_Request] = deque()
        self._control_waiting = 0
        self._running: list[_Request] = []
        self._by_rid: dict[str, _Request] = {}
        self._paused: str | None = None
        self._step_lock = threading.RLock()
        self._wake = threading.Condition()
        self._stop = False
        self._weights_released: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self.stats = {
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "busy_seconds": 0.0,
            "slot_moves": 0,  # KV rows moved to keep running requests in contiguous slots
            "steps": 0,  # engine steps, and the running / waiting requests summed over them
            "prefill_steps": 0,  # engine steps that admitted requests (a prefill forward)
            "running_sum": 0,
            "waiting_sum": 0,
        }
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {SCHEDULERS}")
        self.scheduler = scheduler
        # per-step thread counts (threads.py) where this engine owns the process's compute
        # between its steps; default: only the engine server's main scheduler does
        adapt = scheduler == "main" if adapt_threads is None else adapt_threads
        self.step_threads = StepThreads(model.config, adapt and self.device.type == "cpu")
        self._sampling_key: tuple | None = None  # the last step's sampling parameters ...
        self._sampling: tuple = ()  # ... as tensors, and whether any row truncates
        self._loop_state = "idle"  # idle → running → exited
        self._exited = threading.Event()
        if scheduler == "thread":
            self._loop_state = "running"
            threading.Thread(target=self.run, name="miles-engine", daemon=True).start()

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return self.weights.tensors()

    def weights_checksum(self, scope: str = "all") -> str:
        """sha256 of the weights that generate (`scope`: all, base or adapters): the packed
        copies the runner decodes with are first checked bitwise against the named tensors (a
        stale or corrupt pack fails loudly)."""
        with self.between_steps():
            stale = self.runner.verify_packed() + self.weights.stale()
            if stale:
                raise PackedWeightsDiffer(
                    f"the runner's packed weights differ from the engine's tensors: {stale[:5]}"
                )
            return tensors_checksum(self.weights.tensors(scope))

    def validate(self, req: GenerateRequest) -> None:
        validate_request(req, self.vocab_size, self.max_context)
        check_scoring(req)
        check_adapter(self.adapters, req)
        seed = req.sampling_params.sampling_seed
        if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise EngineRequestError(f"sampling_seed {seed} is outside [-2**63, 2**64)")
        if self._weights_released is not None:
            raise EngineRequestError("weights are released; resume memory occupation first")
        if not self.runner.cache.kv:
            raise EngineRequestError(
                "the KV cache is released; resume memory occupation (tags: kv_cache) first"
            )
        if ROUTES.name in req.return_fields and self.runner.routes_shape is None:
            raise EngineRequestError(
                "return_routed_experts: this model has no mixture-of-experts layers"
            )

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Queues one request; the handle completes when it finishes. With the `caller` scheduler
        nothing steps the engine between `generate` calls, so use `generate` there."""
        if self.scheduler == "caller":
            raise EngineRequestError("this engine steps only inside generate(); call generate")
        return self._enqueue(req)

    def _enqueue(self, req: GenerateRequest) -> RequestHandle:
        self.validate(req)
        if not self.alive():
            raise EngineRequestError("the engine's scheduler has stopped; restart the engine")
        rid = req.rid or uuid.uuid4().hex
        r = _Request(rid=rid, input_ids=list(req.input_ids), req=req)
        if req.sampling_params.sampling_seed is not None:
            r.generator = torch.Generator().manual_seed(req.sampling_params.sampling_seed)
        with self._wake:  # the scheduler moves the inbox into the queue under its step lock
            if rid in self._by_rid:
                raise EngineRequestError(f"request id {rid!r} is already in flight")
            self._by_rid[rid] = r
            if req.lora_path is not None:  # an adapter a request names is never unloaded
                self.adapters.in_use[req.lora_path] += 1
            self._inbox.append(r)
            self._wake.notify()
        return RequestHandle(r)

    def alive(self) -> bool:
        return self._loop_state != "exited"

    @contextlib.contextmanager
    def between_steps(self):
        """Holds the scheduler between two steps for the block. The scheduler yields to a waiting
        control call before its next step, so control calls never starve behind a busy engine."""
        with self._wake:
            self._control_waiting += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._wake:
                self._control_waiting -= 1
                self._wake.notify_all()

    def _drain_inbox(self) -> None:
        """Called with the step lock held: newly submitted requests join the queue."""
        with self._wake:
            while self._inbox:
                self._waiting.append(self._inbox.popleft())

    def generate(
        self, requests: list[GenerateRequest], timeout: float | None = None
    ) -> list[GenerateResponse]:
        for r in requests:
            self.validate(r)
        if self.scheduler == "caller" and self._paused is not None:
            raise EngineRequestError(f"the engine is paused ({self._paused}); continue it first")
        handles = [self._enqueue(r) for r in requests]
        if self.scheduler == "caller":
            self._step_until_done(handles, timeout)
            timeout = 10 if self._stop else 0  # close() is aborting them; else all are done
        return [h.result(timeout) for h in handles]

    def _step_until_done(self, handles: list[RequestHandle], timeout: float | None) -> None:
        """The `caller` scheduler: steps on this thread until the handles finish, with the same
        manners as the scheduler thread (control calls from other threads go first, a pause
        holds the requests, `close` ends it). Requests still running at the deadline are
        aborted, so nothing is left queued with no one to step it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(h.done() for h in handles):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                for h in handles:
                    if not h.done():
                        self.abort(h.rid)
                return
            with self._wake:
                if self._stop:  # close() aborts everything in flight
                    return
                if self._control_waiting or self._paused is not None:
                    self._wake.wait(left)
                    continue
            with self._step_lock:
                if self._paused is None:
                    self._guarded_step()

    # ------------------------------------------------------------------ control
    def abort(self, rid: str | None = None) -> int:
        """Aborts one request (or all with rid=None); returns how many were aborted."""
        with self.between_steps():
            self._drain_inbox()
            with self._wake:
                everyone = list(self._by_rid.values())
            targets = everyone if rid is None else [r for r in everyone if r.rid == rid]
            for r in targets:
                self._finish(r, FinishReason(type="abort"))
            return len(targets)

    def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; choose one of {PAUSE_MODES}")
        with self.between_steps():
            self._drain_inbox()
            self._paused = mode
            if mode == "abort":
                with self._wake:
                    everyone = list(self._by_rid.values())
                for r in everyone:
                    self._finish(r, FinishReason(type="abort"))
            elif mode == "retract":
                for r in reversed(self._running):
                    self._leave_slot(r)
                    self._waiting.appendleft(r)
                self._running = []

    def resume(self) -> None:
        """`/continue_generation`."""
        with self._wake:
            self._paused = None
            self._wake.notify()

    @property
    def paused(self) -> str | None:
        return self._paused

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        flush_cache: bool = True,
        adopt: bool = False,
    ) -> int:
        """Checks every name and shape first, then copies (or, with `adopt`, takes the tensors'
        storage): a bad push changes nothing. Cached prefixes computed with the old weights are
        never reused afterwards (slot epochs)."""
        pairs = list(named_tensors)
        with self.between_steps():
            copied = self.weights.load(pairs, adopt=adopt)
            self.runner.invalidate()
            self.table.new_epoch(flush=flush_cache)
        return copied

    def _rows(self, names: list[str | None]):
        return rows_using(self.adapters, names)

    @contextlib.contextmanager
    def _adapter_turn(self):
        """An adapter table change, between steps; prefixes cached before it are not reused."""
        with self.between_steps():
            yield
            self.table.new_epoch()

    def flush_cache(self) -> bool:
        with self.between_steps():
            if self._running or self._waiting:
                return False
            self.table.flush()
            return True

    def release_memory(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        with self.between_steps():
            self._drain_inbox()
            if self._running or self._waiting:
                raise RuntimeError(
                    "cannot release memory while requests are running or queued; abort them first"
                )
            if "kv_cache" in tags:
                self.table.flush()
                self.runner.cache.release()
            if "weights" in tags and self._weights_released is None:
                self._weights_released = {}
                for n, p in self._params.items():
                    self._weights_released[n] = (p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                self.runner.invalidate()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        with self.between_steps():
            if "kv_cache" in tags:
                self.runner.cache.allocate()
            if "weights" in tags and self._weights_released is not None:
                for n, (shape, dtype) in self._weights_released.items():
                    self._params[n].data = torch.zeros(shape, dtype=dtype, device=self.device)
                self._weights_released = None
                self.runner.invalidate()

    def load_state(self) -> dict[str, float]:
        return {
            "running": float(len(self._running)),
            "waiting": float(len(self._waiting)),
            "cached_slots": float(self.table.count(SlotState.CACHED)),
        }

    def load_counters(self) -> dict[str, float]:
        """Cumulative step and load counters (see `RolloutEngine.load_counters`)."""
        return {k: float(self.stats[k]) for k in ("steps", "running_sum", "waiting_sum")}

    def prefix_cache_hit_rate(self) -> float:
        p = self.stats["prompt_tokens"]
        return self.stats["cached_tokens"] / p if p else 0.0

    def close(self) -> None:
        """Stops the scheduler and aborts every request still in flight."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._loop_state == "running":
            self._exited.wait(timeout=10)
        self._loop_state = "exited"
        self.abort()

    def request_stop(self) -> None:
        """Asks the scheduler loop to end after its current step (safe in a signal handler on the
        thread running `run`: it only sets a flag and notifies)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()

    # ------------------------------------------------------------------ scheduler
    def run(self) -> None:
        """The scheduler loop, until `close`. With the `main` scheduler the process's main thread
        calls this (the HTTP server runs in a thread): libgomp shortens its spin-wait when a process
        has more OpenMP threads than cores, so a second compute thread beside a main thread that
        already used OpenMP makes every parallel op wait on a futex (≈1.7× slower decode on 2 cores).
        """
        self._loop_state = "running"
        try:
            self._loop()
        finally:
            self._loop_state = "exited"
            self._exited.set()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (
                    self._control_waiting
                    or self._paused is not None
                    or not (self._inbox or self._waiting or self._running)
                ):
                    self._wake.wait()
                if self._stop:
                    return
            with self._step_lock:
                if self._paused is not None:
                    continue
                self._guarded_step()

    def _guarded_step(self) -> None:
        """One step, with the step lock held. A failing step aborts every request with the
        error instead of leaving callers waiting forever."""
        t0 = time.perf_counter()
        try:
            self._step()
        except Exception as e:
            log.exception("engine step failed")
            with self._wake:
                everyone = list(self._by_rid.values())
            for r in everyone:
                self._finish(r, FinishReason(type="abort", message=f"engine error: {e!r}"))
        self.stats["busy_seconds"] += time.perf_counter() - t0

    def _step(self) -> None:
        self._drain_inbox()
        admitted = self._admit()
        if admitted:
            self.stats["prefill_steps"] += 1
            chunks = [r.tokens[r.kv_len :] for r in admitted]
            adapters = [r.req.lora_path for r in admitted]
            with self.step_threads.around(sum(len(c) for c in chunks)), self._rows(adapters):
                logits = self.runner.prefill(
                    [r.slot.index for r in admitted], [r.kv_len for r in admitted], chunks
                )
                for r in admitted:
                    r.kv_len = len(r.tokens)
                self._sample(admitted, logits)
        decoding = [r for r in self._running if r not in admitted and r.finish is None]
        self.stats["steps"] += 1
        self.stats["running_sum"] += len(admitted) + len(decoding)
        self.stats["waiting_sum"] += len(self._waiting)
        if decoding:
            self._compact()
            decoding.sort(key=lambda r: r.slot.index)
            adapters = [r.req.lora_path for r in decoding]
            with self.step_threads.around(len(decoding)), self._rows(adapters):
                logits = self.runner.decode(
                    [r.slot.index for r in decoding],
                    [len(r.input_ids) + len(r.output) - 1 for r in decoding],
                    [r.output[-1] for r in decoding],
                )
                for r in decoding:
                    r.kv_len = len(r.input_ids) + len(r.output)
                self._sample(decoding, logits)

    def _compact(self) -> None:
        """Moves running requests into slots 0..n-1, so a decode step reads the KV cache as one
        view instead of gathering it per layer. Each request moves at most once per change of
        the running set (a finished request's hole is filled by one swap)."""
        n = len(self._running)
        outside = [r for r in self._running if r.slot.index >= n]
        if not outside:
            return
        inside = {r.slot.index for r in self._running}
        holes = iter(i for i in range(n) if i not in inside)
        for r in outside:
            other = self.table.slots[next(holes)]
            length = max(len(r.slot.tokens), len(other.tokens))
            self.runner.cache.swap(r.slot.index, other.index, length)
            self.table.swap(r.slot, other)
            self.stats["slot_moves"] += 1

    def _admit(self) -> list[_Request]:
        """Moves waiting requests into slots. A request whose best prefix match is a slot being
        filled in this same step waits one step, then copies that prefix (GRPO siblings)."""
        admitted: list[_Request] = []
        new_slots: set[int] = set()
        deferred: list[_Request] = []
        while self._waiting and len(self._running) < self.max_running:
            r = self._waiting.popleft()
            tokens = r.tokens
            match, lcp = self.table.best_match(tokens, exclude=set(), adapter=r.req.lora_path)
            if match is not None and match.index in new_slots:
                deferred.append(r)
                continue
            if match is not None and match.state == SlotState.CACHED:
                slot = self.table.take(match)
            else:
                slot = self.table.allocate()
                if slot is None:
                    self._waiting.appendleft(r)
                    break
                if match is not None:
                    self.runner.cache.copy_prefix(match.index, slot.index, lcp)
                else:
                    lcp = 0
            r.slot, r.kv_len = slot, lcp
            slot.tokens = tokens  # what the slot holds once this step's prefill ran
            slot.adapter = r.req.lora_path  # its keys and values were computed with
            new_slots.add(slot.index)
            if not r.output:  # a request's first admission counts for the prefix-cache rate
                r.cached_tokens = lcp
                self.stats["prompt_tokens"] += len(r.input_ids)
                self.stats["cached_tokens"] += lcp
            if r.req.sampling_params.max_new_tokens == 0:
                self._finish(r, FinishReason(type="length", length=0))
                continue
            self._running.append(r)
            admitted.append(r)
        self._waiting.extendleft(reversed(deferred))
        return admitted

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        dev = logits.device
        params = tuple(
            (sp.effective_temperature(), sp.effective_top_k(), sp.top_p)
            for sp in (r.req.sampling_params for r in reqs)
        )
        if self._sampling_key != (params, dev):  # the running set's parameters, built once
            temperature, top_k, top_p = zip(*params, strict=True)
            self._sampling_key = (params, dev)
            self._sampling = (
                torch.tensor(temperature, dtype=torch.float32, device=dev),
                torch.tensor(top_k, dtype=torch.long, device=dev),
                torch.tensor(top_p, dtype=torch.float32, device=dev),
                any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            )
        temperature, top_k, top_p, truncate = self._sampling
        # one draw of the engine's generator per step (its stream does not depend on which
        # requests are seeded); a seeded request takes the next number of its own stream
        drawn = torch.rand(len(reqs), generator=self.generator, dtype=torch.float64)
        if any(r.generator is not None for r in reqs):
            values = drawn.tolist()
            for i, r in enumerate(reqs):
                if r.generator is not None:
                    values[i] = self._next_uniform(r)
            drawn = torch.tensor(values, dtype=torch.float64)
        tokens, lps = sample_next(
            logits, temperature, top_k, top_p, drawn.to(dev), truncate, self.true_on_policy
        )
        for r, t, lp in zip(reqs, tokens.tolist(), lps.tolist(), strict=True):
            r.output.append(t)
            r.logprobs.append(lp)
            r.versions.append(self._version)
            held = r.slot.tokens  # the KV now covers every token but the one just sampled
            if len(held) == r.kv_len - 1:
                held.append(r.input_ids[-1] if len(r.output) == 1 else r.output[-2])
            elif len(held) != r.kv_len:
                r.slot.tokens = r.tokens[: r.kv_len]
            self.stats["generated_tokens"] += 1
            sp = r.req.sampling_params
            if sp.stop_token_ids and t in sp.stop_token_ids:
                self._finish(r, FinishReason(type="stop", matched=t))
            elif len(r.output) >= sp.max_new_tokens:
                self._finish(r, FinishReason(type="length", length=len(r.output)))

    @staticmethod
    def _next_uniform(r: _Request) -> float:
        """The next number of a seeded request's stream. Numbers are drawn ahead, up to the
        tokens it may still sample: `torch.rand(k)` gives the same numbers, in the same order,
        as k draws of `torch.rand(1)` from that generator (one op instead of k)."""
        if not r.uniforms:
            left = r.req.sampling_params.max_new_tokens - len(r.output)
            k = max(1, min(left, UNIFORMS_AHEAD))
            r.uniforms = torch.rand(k, generator=r.generator, dtype=torch.float64).tolist()[::-1]
        return r.uniforms.pop()

    def _leave_slot(self, r: _Request) -> None:
        if r.slot is not None:
            self.table.park(r.slot, r.tokens[: r.kv_len])
            r.slot = None

    def _routed_experts(self, r: _Request) -> dict[str, str]:
        """`meta_info.routed_experts` of a finishing request: the routes its slot holds for
        every position but the last (tokens − 1 rows). A request that ends before its tokens
        were all processed (aborted while waiting) has none to give: the key is left out, and
        its continuation returns the rows."""
        n = len(r.tokens) - 1
        if r.slot is None or r.kv_len != n:
            return {}
        routes = self.runner.routes_of(r.slot.index, n)
        return {} if routes is None else {ROUTES.wire_key: encode_routes(routes.numpy())}

    def _finish(self, r: _Request, reason: FinishReason) -> None:
        """Called with the step lock held."""
        if r.done.is_set():
            return
        r.finish = reason
        extra = self._routed_experts(r) if ROUTES.name in r.req.return_fields else {}
        if token_versions.reported(r.req.return_fields, self.true_on_policy):
            extra[TOKEN_VERSIONS.wire_key] = list(r.versions)
        if reason.type != "abort":  # the input's log-probs, when asked (prompt_logprobs.py)
            extra |= self.scorer.meta(r.req)
        self._leave_slot(r)
        if r in self._running:
            self._running.remove(r)
        if r in self._waiting:
            self._waiting.remove(r)
        with self._wake:
            if self._by_rid.get(r.rid) is r:
                del self._by_rid[r.rid]
            if r.req.lora_path is not None:
                self.adapters.in_use[r.req.lora_path] -= 1
        r.response = GenerateResponse(
            text=self.tokenizer.decode(r.output, skip_special_tokens=True)
            if self.tokenizer
            else "",
            output_ids=list(r.output),
            meta_info=MetaInfo(
                id=r.rid,
                finish_reason=reason,
                prompt_tokens=len(r.input_ids),
                completion_tokens=len(r.output),
                cached_tokens=r.cached_tokens,
                weight_version=str(self._version),
                output_token_logprobs=[
                    (lp, t, None) for lp, t in zip(r.logprobs, r.output, strict=True)
                ],
                **extra,
            ),
        )
        with r.lock:
            r.done.set()
            callbacks, r.callbacks = r.callbacks, []
        for fn in callbacks:
            fn(r.response)
