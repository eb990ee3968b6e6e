"""The episode sandbox (bubblewrap): every escape attempt is blocked and reported, the host is
untouched, and the sandbox keeps working afterwards."""

from pathlib import Path

import pytest

from miles_core.envs.sandbox import Sandbox, SandboxLimits

LIMITS = SandboxLimits(cpu_s=2, wall_s=4, memory_mb=256, processes=32, file_mb=1, output_kb=4)


@pytest.fixture
def sandbox():
    with Sandbox(LIMITS) as sb:  # in the system temp dir: passable by the sandbox's uid
        yield sb


def test_commands_work_inside_the_workspace(sandbox):
    r = sandbox.run("echo hi > a.txt && cat a.txt && python3 -c 'print(6*7)' && pwd")
    assert r.ok and r.output == "hi\n42\n/workspace\n"
    assert sandbox.read("a.txt") == "hi\n"
    sandbox.write("sub/b.txt", "from the host")
    assert sandbox.run("cat sub/b.txt").output == "from the host"


def test_no_network(sandbox):
    r = sandbox.run(
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)\""
    )
    assert not r.ok and ("Network is unreachable" in r.output or "refused" in r.output)
    assert sandbox.run("cat /proc/net/dev").output.count(":") == 1  # only lo, and it is down


def test_nothing_of_the_host_outside_the_workspace_is_readable_or_writable(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    r = sandbox.run(f"cat {secret}; cat /etc/shadow; ls /root /home /work")
    assert "host secret" not in r.output and "No such file" in r.output
    assert "Permission denied" in r.output  # /etc/shadow: visible, read-only, not readable
    r = sandbox.run("echo x > /usr/evil; echo x > /etc/evil; echo x > ../evil; echo ok > /tmp/t")
    assert "Read-only file system" in r.output
    assert not Path("/usr/evil").exists() and not Path("/etc/evil").exists()
    assert not (sandbox.root / "evil").exists()
    with pytest.raises(ValueError, match="outside the workspace"):
        sandbox.write("../escape.txt", "x")


def test_a_workspace_parent_the_sandbox_cannot_pass_is_refused(tmp_path):
    import os

    from miles_core.envs.sandbox import SandboxUnavailable

    if os.geteuid() != 0:
        pytest.skip("only root gives each sandbox its own uid")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(SandboxUnavailable, match="not passable"):
        Sandbox(LIMITS, parent=closed)


def test_as_root_each_sandbox_runs_as_its_own_uid_with_no_groups_or_capabilities(sandbox):
    import os

    if os.geteuid() != 0:
        pytest.skip("only root gives each sandbox its own uid")
    r = sandbox.run("id -u; id -g; id -G; grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status")
    uid = str(sandbox.uid)
    lines = r.output.split("\n")
    assert lines[:3] == [uid, uid, uid], r.output  # dropped by setpriv in the exec chain
    assert all(line.endswith("0000000000000000") for line in lines[3:6]), r.output


def test_a_fork_bomb_is_capped_and_cleaned_up(sandbox):
    r = sandbox.run("bomb() { bomb | bomb & }; bomb; sleep 1; echo done")
    assert "Cannot fork" in r.output or r.killed_by is not None
    assert r.seconds < LIMITS.wall_s + 2
    assert sandbox.run("echo alive").output == "alive\n"  # nothing left behind hogs it


def test_memory_blow_up_fails_inside_the_sandbox(sandbox):
    r = sandbox.run("python3 -c 'x = bytearray(2 * 1024**3); print(len(x))'")
    assert not r.ok and "MemoryError" in r.output


def test_an_endless_loop_is_stopped_by_cpu_time_and_a_sleeper_by_wall_time(sandbox):
    r = sandbox.run("while true; do :; done")
    assert r.killed_by == "cpu time" and r.seconds < LIMITS.cpu_s + 2
    r = sandbox.run("sleep 100")
    assert r.killed_by == "wall time" and r.seconds < LIMITS.wall_s + 2


def test_the_private_tmp_is_small(sandbox):
    r = sandbox.run("for i in 1 2 3 4 5 6; do head -c 1000000 /dev/zero > /tmp/f$i || exit 1; done")
    assert r.ok  # small files are fine
    r = sandbox.run(
        "for i in $(seq 1 100); do head -c 1000000 /dev/zero > /tmp/g$i || exit 1; done"
    )
    assert not r.ok and "No space left" in r.output  # 100 MB does not fit in 64 MiB


def test_huge_output_and_huge_files_are_cut(sandbox):
    r = sandbox.run("yes aaaaaaaaaa")
    assert r.killed_by == "file size" and r.truncated and len(r.output) <= 4 * 1024
    r = sandbox.run("head -c 5000000 /dev/zero > big.bin")
    assert not r.ok
    assert (sandbox.workspace / "big.bin").stat().st_size <= 1 << 20


def test_links_in_the_workspace_are_reported_and_never_followed(sandbox):
    """A linked answer file is not the answer: the host-side helpers report a link as one, to a
    file of the workspace or outside it, as the path or on the way, and never follow it."""
    from miles_core.envs.terminal import TerminalTask
    from miles_core.envs.workspace import WorkspaceLink

    sandbox.write("real.txt", "the answer")
    r = sandbox.run("ln -s real.txt answer.txt && ln -s /etc etc && mkdir d && ln -s d e")
    assert r.ok, r.output
    assert [sandbox.kind(p) for p in ("real.txt", "answer.txt", "etc/passwd", "e/x", "d")] == [
        "file",
        "link",
        "link",
        "link",
        "directory",
    ]
    with pytest.raises(WorkspaceLink, match=r"'answer.txt' .* link \(to 'real.txt'\)"):
        sandbox.read("answer.txt")
    with pytest.raises(WorkspaceLink, match="'etc'"):
        sandbox.read("etc/hostname")
    with pytest.raises(WorkspaceLink):
        sandbox.write("etc/evil", "x")  # through a link: refused, nothing written
    assert not Path("/etc/evil").exists()
    task = TerminalTask("create", "", checks=[{"file": "answer.txt", "equals": "the answer"}])
    assert task.check(sandbox) == 0.0
    sandbox.write("answer.txt", "restored")  # the link itself is replaced, not its target
    assert sandbox.kind("answer.txt") == "file" and sandbox.read("real.txt") == "the answer"
    assert task.check(sandbox) == 0.0 and sandbox.read("answer.txt") == "restored"


def test_a_workspace_never_holds_more_than_its_disk_quota():
    """1 MiB per file, 3 MiB in all: a command writing 1 MiB files without end is stopped
    ("disk quota") and what it wrote past the quota is cut; what was there before is kept."""
    limits = SandboxLimits(cpu_s=10, wall_s=20, file_mb=1, disk_mb=3)
    with Sandbox(limits) as sb:
        sb.write("kept.txt", "x" * 500_000)
        r = sb.run("i=0; while true; do head -c 1048576 /dev/zero > f$i; i=$((i+1)); done")
        assert r.killed_by == "disk quota" and r.seconds < 10, r
        assert sb.files.usage() <= 3 << 20
        assert sb.read("kept.txt") == "x" * 500_000
        r = sb.run("head -c 4000000 /dev/zero | split -b 1000000 - g")  # faster than a poll
        assert r.killed_by == "disk quota" and sb.files.usage() <= 3 << 20
        assert sb.run("rm -f f* g* && echo ok").output == "ok\n"  # room again


@pytest.mark.slow
def test_every_sandboxed_process_is_reaped_here(sandbox):
    """200 commands, some leaving a process behind: no zombie anywhere afterwards, and no
    process of ours left (bwrap's namespace init is reaped inside the sandbox's own PID
    namespace, not handed to PID 1)."""
    import psutil

    def zombies() -> set[int]:
        return {p.pid for p in psutil.process_iter(["status"]) if p.info["status"] == "zombie"}

    before = zombies()
    for i in range(200):
        assert sandbox.run("sleep 5 &" if i % 20 == 0 else "true").ok
    assert sandbox.run("sleep 100").killed_by == "wall time"
    assert zombies() - before == set()
    chain = {"prlimit", "unshare", "setpriv", "bwrap", "sh", "sleep", "true"}
    assert [p for p in psutil.Process().children(recursive=True) if p.name() in chain] == []
