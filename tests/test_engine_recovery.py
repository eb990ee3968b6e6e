"""Engine crash recovery: a killed (SIGKILL) or hung (SIGSTOP) engine server is detected within
10 s, replaced on the same port, given the trainer's weights before it serves, and the requests
it was serving are re-issued exactly once, so every sample is trained exactly once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_core.config import load_config
from miles_core.data import PromptSource, load_examples
from miles_core.engines.http import EngineProcess, EngineUnavailable, HttpEngine
from miles_core.engines.supervisor import EngineSupervisor
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.run.runtime import RLRuntime, prepare_model_dir

B, N, STEPS = 4, 2, 4


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "name=recovery-test",
            "model.preset=tiny",
            "data.task=reverse",
            f"rollout.prompts_per_step={B}",
            f"rollout.n_samples_per_prompt={N}",
            "rollout.max_new_tokens=128",
            f"train.num_steps={STEPS}",
            f"train.global_batch_size={B * N}",
            f"train.micro_batch_size={B * N}",
            "train.lr=3e-3",
            "train.threads=1",
            "rollout.engine=server",
            "rollout.engine_options.threads=1",
            "weight_sync.transport=shared_memory",
            "weight_sync.check_equal=true",
            f"checkpoint.root={tmp_path}/ckpt",
            *extra,
        ],
    )


class Saboteur:
    """Signals the engine process once requests are in flight (polls /get_server_info)."""

    def __init__(self, process: EngineProcess, sig: int):
        self.process, self.sig = process, sig
        self.popen: subprocess.Popen | None = None  # the process it signalled
        self.at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop = threading.Event()

    def start(self) -> Saboteur:
        self._thread.start()
        return self

    def _run(self) -> None:
        # the run's engine requires the run's key (processes/auth.py)
        with httpx.Client(
            base_url=self.process.url, timeout=2.0, headers=self.process.headers
        ) as client:
            while not self._stop.is_set():
                try:
                    if client.get("/get_server_info").json()["running"] >= 1:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.002)
            else:
                return
        self.popen = self.process.proc
        self.at = time.monotonic()
        self.strike()

    def strike(self) -> None:
        os.kill(self.popen.pid, self.sig)

    def join(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def cleanup(self) -> None:
        """A stopped process the supervisor did not kill must not outlive the test."""
        self.join()
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(10)


def _run(cfg, sig: int | None, during_step: int = 1, saboteur_class: type | None = None):
    """STEPS steps on an RLRuntime; `sig` is sent to the engine mid-rollout in `during_step`.
    Returns the trained rollout ids and data indices per step, metrics, and the runtime's
    supervisor and saboteur after close."""
    rt = RLRuntime(cfg, prepare_model_dir(cfg, Path(tempfile.mkdtemp())), None)
    saboteur, trained, metrics = None, [], []
    try:
        first_pid = rt.engine_process.pid
        for step in range(STEPS):
            if sig is not None and step == during_step:
                saboteur = (saboteur_class or Saboteur)(rt.engine_process, sig).start()
            result = rt.rollout(step)
            trained.append(
                [(s.rollout_id, s.metadata["data_index"], s.tokens) for s in result.samples]
            )
            rt.train(result)
            rt.update_weights()  # check_equal: the engine holds exactly the trainer's weights
            metrics.append(result.metrics)
        rt.check_weights_equal()
        assert rt.engine.weight_version == rt.policy_version == STEPS
        pids = (first_pid, rt.engine_process.pid)
    finally:
        if saboteur is not None:
            saboteur.cleanup()
        rt.close()
    assert rt.engine_process.proc.poll() is not None  # the replacement is stopped too
    return trained, metrics, rt.supervisor, saboteur, pids


def _sync_order(cfg) -> list[list[int]]:
    d = cfg.data
    source = PromptSource(
        load_examples(d.task, d.path, d.num_prompts, d.seed, d.storage_options),
        seed=d.seed,
        shuffle=d.shuffle,
    )
    return [[i for i, _ in source.next_batch(B) for _ in range(N)] for _ in range(STEPS)]


def _check_recovered(trained, metrics, supervisor, saboteur, pids, cfg, routed=False) -> None:
    """`routed`: the engine was one of several behind sglang-router, which sends a call whose
    engine died to another engine itself; nothing is left for the supervisor to re-issue."""
    assert saboteur is not None and saboteur.at is not None, "the engine was never signalled"
    assert supervisor.generation == 1 and len(supervisor.replacements) == 1
    event = supervisor.replacements[0]
    assert event.detected_at - saboteur.at <= 10.0, event
    assert event.old_pid == pids[0] == saboteur.popen.pid
    assert event.new_pid == pids[1] != pids[0]
    assert supervisor.reissued >= (0 if routed else 1)  # requests were in flight when it died
    assert metrics[-1]["rollout/engine_restarts_total"] == 1.0
    assert metrics[-1]["rollout/reissued_requests_total"] == supervisor.reissued
    # every sample trained exactly once: no duplicate and no missing rollout id or prompt
    ids = [rid for step in trained for rid, _, _ in step]
    assert len(ids) == len(set(ids)) == STEPS * B * N
    assert [[d for _, d, _ in step] for step in trained] == _sync_order(cfg)


@pytest.mark.slow
def test_a_killed_engine_in_fully_async_mode_is_replaced_and_nothing_is_lost(tmp_path, caplog):
    # over disk deltas: the replacement gets a full push, the next push is a delta from it
    # (fully async over shared memory, the default here, is the hung-engine test below)
    delta = ["weight_sync.transport=disk", "weight_sync.transport_options.delta=true"]
    cfg = _config(
        tmp_path, "rollout.mode=fully_async", "rollout.mode_options.max_staleness=1", *delta
    )
    with caplog.at_level(logging.INFO, logger="miles"):
        trained, metrics, sup, sab, pids = _run(cfg, signal.SIGKILL)
    _check_recovered(trained, metrics, sup, sab, pids, cfg)
    assert max(m["rollout/staleness/max"] for m in metrics) <= 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"(pid {pids[0]}) is dead: process {pids[0]} exited with code -9" in text
    assert f"replaced: pid {pids[0]} -> {pids[1]}" in text
    assert "replaced engine server got policy version" in text


@pytest.mark.slow
def test_a_killed_engine_in_sync_mode_gives_the_samples_of_an_uninterrupted_run(tmp_path):
    cfg = _config(tmp_path)
    trained, metrics, sup, sab, pids = _run(cfg, signal.SIGKILL)
    _check_recovered(trained, metrics, sup, sab, pids, cfg)
    # re-issued with the same rid and seed on the same weights: the same tokens as a healthy run
    healthy, _, _, _, _ = _run(_config(tmp_path / "healthy"), None)
    assert trained == healthy


@pytest.mark.slow
def test_a_hung_engine_is_detected_within_10_seconds_and_replaced(tmp_path, caplog):
    cfg = _config(tmp_path, "rollout.mode=fully_async")
    with caplog.at_level(logging.WARNING, logger="miles.engine"):
        trained, metrics, sup, sab, pids = _run(cfg, signal.SIGSTOP)
    _check_recovered(trained, metrics, sup, sab, pids, cfg)
    assert "no healthy answer for" in sup.replacements[0].reason
    assert sab.popen.returncode == -signal.SIGKILL  # the supervisor killed the stopped process


def _requests(tok, n: int, max_new_tokens: int) -> list[GenerateRequest]:
    ids = tok.encode("say a", add_special_tokens=False)
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    return [
        GenerateRequest(
            input_ids=ids,
            sampling_params=sp.model_copy(update={"sampling_seed": i}),
            rid=f"r{i}",
        )
        for i in range(n)
    ]


@pytest.mark.slow
def test_a_request_is_reissued_only_once_and_restarts_are_bounded(tiny_dir, tiny, tmp_path):
    """Two deaths in a row: the calls re-issued after the first fail again with the second,
    which the supervisor (max_restarts=1) does not repair; both say so clearly."""
    _, tok = tiny
    proc = EngineProcess(tiny_dir, args=["--threads", "1"], log_path=tmp_path / "engine.log")
    proc.start()
    served: list[int] = []
    sup = EngineSupervisor(
        proc, lambda: served.append(proc.pid), interval_s=0.5, timeout_s=3.0, max_restarts=1
    )
    client = HttpEngine(proc.url, concurrency=16)
    client.supervisor = sup.start()
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            client.generate(_requests(tok, 32, 450))
        except EngineUnavailable as e:
            errors.append(e)

    worker = threading.Thread(target=generate)
    saboteurs = []
    try:
        worker.start()
        saboteurs.append(Saboteur(proc, signal.SIGKILL).start())
        deadline = time.monotonic() + 60
        while sup.generation < 1:  # replaced; the re-issued calls now run on the new engine
            assert time.monotonic() < deadline, "no replacement"
            time.sleep(0.01)
        saboteurs.append(Saboteur(proc, signal.SIGKILL).start())
        worker.join(60)
        assert not worker.is_alive()
        while sup.state != "failed":  # the second death is not repaired
            assert time.monotonic() < deadline, sup.state
            time.sleep(0.01)
    finally:
        for s in saboteurs:
            s.cleanup()
        sup.stop()
        client.close()
        proc.stop()
    assert served == [sup.replacements[0].new_pid]  # weights served before the re-issue
    assert sup.reissued >= 1 and sup.state == "failed"
    assert "failed again after the engine server was replaced (re-issued once" in str(errors[0])
    assert "rollout.engine_options.max_engine_restarts=1" in sup.failure
    with pytest.raises(EngineUnavailable, match="max_engine_restarts"):
        client.generate(_requests(tok, 1, 2))
