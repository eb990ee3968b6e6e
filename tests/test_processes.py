"""Process plumbing: servers bind their own port and report it (no choose-then-bind race), a port
range keeps them inside it, PID identity survives PID reuse, a stopped server takes what it
started with it, and a failed run leaves no temp folder behind. Real processes and sockets."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from infra.processes import ProcessRecord, record_alive, stop_group
from miles_core.eval.service import EvalServiceProcess
from miles_core.processes.identity import ProcessIdentity, pid_alive
from miles_core.processes.managed import ManagedProcess, ProcessUnavailable
from miles_core.processes.parent_watch import parent_alive
from miles_core.processes.ports import NoFreePort, PortRange, bind

SCRIPTS = Path(__file__).parent / "scripts"


def _free_pair(low: int = 42000, high: int = 60000) -> PortRange:
    """Two consecutive ports that are free now."""
    for port in range(low, high, 2):
        try:
            with bind(port=port), bind(port=port + 1):
                return PortRange(port, port + 1)
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _start_all(processes: list[ManagedProcess]) -> list:
    """Starts them at the same time; returns each start's result or exception."""

    def start(p: ManagedProcess):
        try:
            return p.start(timeout=120)
        except Exception as e:  # noqa: BLE001  (returned to the test)
            return e

    with ThreadPoolExecutor(len(processes)) as pool:
        return list(pool.map(start, processes))


# ---------------------------------------------------------------- ports


def test_servers_started_at_once_bind_their_own_ports_inside_the_range_and_report_them(tmp_path):
    """Three servers start at the same moment over a range of two ports: two bind distinct ports
    of the range and answer /health there, each from its own listening socket; the third fails
    with a clear error naming the range."""
    allowed = _free_pair()
    procs = [
        EvalServiceProcess(log_path=tmp_path / f"s{i}.log", port_range=allowed) for i in range(3)
    ]
    assert all(p.port is None for p in procs)  # nothing picked in advance
    try:
        results = _start_all(procs)
        started = [p for p, r in zip(procs, results, strict=True) if r is p]
        failed = [r for r in results if isinstance(r, Exception)]
        assert sorted(p.port for p in started) == [allowed.low, allowed.high], results
        assert len(failed) == 1 and isinstance(failed[0], ProcessUnavailable)
        assert f"no free port in {allowed} on 127.0.0.1: all 2 are in use" in str(failed[0])
        for p in started:
            assert httpx.get(f"{p.url}/health", timeout=5).status_code == 200
            listening = {
                c.laddr.port
                for c in psutil.Process(p.pid).net_connections()
                if c.status == "LISTEN"
            }
            assert listening == {p.port}  # the reported port is the server's own socket
    finally:
        for p in procs:
            p.stop()


def test_a_server_without_a_range_reports_the_port_the_kernel_gave_it(tmp_path):
    """`--port 0 --port-file F` by hand: the file holds the port the server listens on, and the
    first line on stderr says so."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_core.eval.service", "--port", "0"]
        + ["--port-file", str(port_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # one line, once it is about to serve
        port = int(port_file.read_text())
        assert line.strip() == f"evaluation service listening on 127.0.0.1:{port}"
        assert port > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_bind_takes_the_first_free_port_of_a_range_and_refuses_a_full_one():
    allowed = _free_pair()
    with bind(port_range=allowed) as first, bind(port_range=allowed) as second:
        assert [first.getsockname()[1], second.getsockname()[1]] == [allowed.low, allowed.high]
        with pytest.raises(NoFreePort, match=f"no free port in {allowed}"):
            bind(port_range=allowed)
        with pytest.raises(OSError):  # a named port that is taken is not silently replaced
            bind(port=allowed.low)


@pytest.mark.parametrize(
    "text, message",
    [
        ("abc", "expected LOW-HIGH"),
        ("30100-30000", "need 1 <= low <= high <= 65535"),
        ("0-10", "need 1 <= low <= high <= 65535"),
    ],
)
def test_a_bad_port_range_is_refused_by_the_config(text, message):
    from pydantic import ValidationError

    from miles_core.config import load_config

    with pytest.raises(ValidationError, match=message):
        load_config(None, [f"network.port_range={text}"])
    assert load_config(None, ["network.port_range=30000-30100"]).network.ports == PortRange(
        30000, 30100
    )


def test_the_trainer_rendezvous_stays_in_the_port_range():
    """Two torchrun ranks: the static rendezvous binds a port of the range and the ranks' default
    group meets there (no other port is handed to them)."""
    from flows.cli import torchrun_command

    allowed = _free_pair()
    cmd = torchrun_command(2, allowed, target=(str(SCRIPTS / "rendezvous_port.py"),))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    assert {line["sum"] for line in lines} == {2}
    ports = {line["master_port"] for line in lines}
    assert len(ports) == 1 and ports <= set(allowed), ports
    with bind(port_range=allowed), bind(port_range=allowed):  # both taken: refused up front
        with pytest.raises(NoFreePort):
            torchrun_command(2, allowed)
    assert "--standalone" in torchrun_command(2)  # no range: torchrun binds port 0 itself


# ---------------------------------------------------------------- PID identity


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reused_pid_is_not_taken_for_the_recorded_process():
    proc = _sleeper()
    try:
        ours = ProcessIdentity.of(proc.pid)
        assert ours is not None and ours.alive()
        # the same number held by a process started at another time: what a reused PID looks like
        stranger = ProcessIdentity(proc.pid, ours.create_time - 1.0)
        assert not stranger.alive()
        assert not parent_alive(proc.pid, direct=False, identity=stranger)
        assert parent_alive(proc.pid, direct=False, identity=ours)
        record = ProcessRecord(
            "svc", proc.pid, stranger.create_time, 1, "http://x", "http://x/h", "log", ["x"]
        )
        assert not record_alive(record)
        assert stop_group(record, timeout=1) == "not running"
        assert proc.poll() is None  # the other program was left alone
    finally:
        proc.kill()
        proc.wait()
    assert not ours.alive()


def test_an_exited_process_is_gone_before_and_after_it_is_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = ProcessIdentity.of(proc.pid)
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pid_alive(proc.pid) and (ident is None or not ident.alive())
    proc.wait()
    assert not pid_alive(proc.pid) and ProcessIdentity.of(proc.pid) is None


def test_a_record_written_with_start_ticks_still_names_its_process(tmp_path):
    """Records from before psutil hold /proc start ticks; they still identify the process."""
    proc = _sleeper()
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        path = tmp_path / "svc.json"
        fields = dict(
            name="svc", pid=proc.pid, port=1, url="u", health_url="h", log="l", command=["x"]
        )
        path.write_text(json.dumps({**fields, "start_ticks": ticks}))
        assert record_alive(ProcessRecord.load(path))
        path.write_text(json.dumps({**fields, "start_ticks": ticks - 500}))
        assert not record_alive(ProcessRecord.load(path))
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- stopping


class _Forking(ManagedProcess):
    """An HTTP server that first starts a grandchild (writes its PID to a file)."""

    what = "forking server"
    health_path = "/"

    def __init__(self, pid_file: Path):
        super().__init__()
        self.pid_file = pid_file

    def command(self) -> list[str]:
        code = (
            "import subprocess, sys, http.server\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(self.pid_file)!r}, 'w').write(str(child.pid))\n"
            f"http.server.HTTPServer(('127.0.0.1', {self.port}), "
            "http.server.SimpleHTTPRequestHandler).serve_forever()\n"
        )
        return [sys.executable, "-c", code]


def test_stop_also_ends_the_processes_the_server_started(tmp_path):
    server = _Forking(tmp_path / "child.pid").start(timeout=60)
    try:
        grandchild = int((tmp_path / "child.pid").read_text())
        assert pid_alive(grandchild)
    finally:
        server.stop(timeout=5)
    assert server.proc.returncode == -signal.SIGTERM
    assert not pid_alive(grandchild)


# ---------------------------------------------------------------- temp folders


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_a_failing_run_leaves_no_temp_folder(prefect_server, tmp_path, monkeypatch):
    """A run whose reward function stops it (SystemExit inside a step), with an engine server
    in a port range: every `miles-*` folder it made in the temp dir (its own, so the check is
    exact) is gone."""
    from flows.rl_train import rl_train
    from miles_core.config import load_config

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        made.append(Path(path))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    ports: list[int] = []
    real_start = ManagedProcess.start

    def recording_start(self, *args, **kwargs):
        started = real_start(self, *args, **kwargs)
        ports.append(self.port)
        return started

    monkeypatch.setattr(ManagedProcess, "start", recording_start)
    allowed = _free_pair()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(SCRIPTS))
    config = load_config(
        None,
        [
            "name=fails",
            "model.preset=tiny",
            "data.task=failing_task:FailsOnSecondRollout",
            "rollout.engine=server",
            "rollout.engine_options.threads=1",
            "weight_sync.transport=shared_memory",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "train.num_steps=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            f"checkpoint.root={tmp_path}/ckpt",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            "tracking.experiment=temp-folders",
            f"network.port_range={allowed}",  # the engine server binds inside it
        ],
    )
    with pytest.raises(SystemExit, match="reward function stopped the run"):
        rl_train(config)
    assert len(ports) == 1 and ports[0] in allowed, ports
    ours = {p.name.split("-")[1] for p in made if p.name.startswith("miles-")}
    assert {"run", "port"} <= ours, made  # the run's folders and the engine's port report
    left = sorted(p.name for p in temp.iterdir() if p.name.startswith("miles-"))
    assert left == [], left
    assert not [p for p in made if p.exists()]


def test_a_bound_server_socket_answers_without_nagle_delay():
    """Servers bind with `bind()` and serve on that socket: the connections asyncio accepts on it
    must have TCP_NODELAY, which asyncio sets only for sockets made with IPPROTO_TCP (with 0,
    every small reply waited ≈45 ms for the client's delayed ACK)."""
    import asyncio
    import socket

    async def accepted_nodelay() -> int:
        sock = bind()
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            s = writer.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
