"""`ddeploy launch | logs | stop` on real OpenSSH test hosts, with a stand-in for the server
(`--set server_command=...`): the script, env file and log land next to the checkout, the recorded
pid is the server's, and stop ends exactly that process group."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployer.ops.launch import build_cache_dir
from processes import alive, parent
from test_bench_interrupt import CLI, ROOT

pytestmark = pytest.mark.sshd

STAND_IN = "import sys, time; print('stand-in server', *sys.argv[1:3], flush=True); time.sleep(300)"
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('stubborn server', flush=True); time.sleep(300)"
)


def _launch_dir(host) -> Path:
    """The host's default launch dir (scripts and logs), emptied, and its launch records too."""
    path = host.checkout.parent / "ddeploy-launch"
    shutil.rmtree(path, ignore_errors=True)  # launch state lives outside the checkout the fixture resets
    shutil.rmtree(_launches(host), ignore_errors=True)
    return path


def _launches(host) -> Path:
    """Where the agent keeps the host's launch record and lock, whatever launch_dir a launch used."""
    return host.cache_dir / "launches"


def _record(host) -> dict:
    return json.loads((_launches(host) / "launch.json").read_text())


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_launch_starts_detached_logs_show_output_and_stop_ends_exactly_that_process(ddeploy, hosts):
    h1 = hosts.host("h1")
    launch_dir = _launch_dir(h1)
    server = shlex.join([sys.executable, "-c", STAND_IN])
    r = ddeploy("launch", "--host", "h1", "-t", "tp8", "--set", f"server_command={server}")
    assert r.code == 0, r.stderr
    record = _record(h1)
    (unit,) = record["units"]
    pid = unit["pid"]
    assert record["topology"] == "tp8" and record["state"] == "running" and f"(pid {pid})" in r.stderr
    assert stat_mode(launch_dir / "tp8" / "h1-tp8.sh") == 0o755 and (launch_dir / "tp8" / "h1-tp8.env").is_file()
    # bash exec'd the server: the recorded pid runs our command, leading its own session
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert cmdline[:3] == [sys.executable.encode(), b"-c", STAND_IN.encode()] and os.getsid(pid) == pid
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in environ and b"NCCL_P2P_DISABLE=1" in environ  # env file sourced
    assert "[h1] no patch set applied: JIT kernels will compile at first use" in r.stderr
    assert not any(e.startswith(b"SGLANG_CRASH_ON_JIT_COMPILE") for e in environ)
    twin = subprocess.Popen([c.decode() for c in cmdline], stdout=subprocess.DEVNULL, start_new_session=True)
    follow = None
    try:
        assert _wait_for(
            lambda: (
                "stand-in server --model-path moonshotai/Kimi-K2.6" in ddeploy("logs", "--host", "h1", "-n", "5").stdout
            )
        )
        follow = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from deployer.cli import main; main()",
                "-i",
                str(hosts.inventory_dir),
                "logs",
                "--host",
                "h1",
                "-n",
                "1",
                "--follow",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert "stand-in server --model-path" in follow.stdout.readline()
        again = ddeploy("launch", "--host", "h1", "-t", "tp8", "--set", f"server_command={server}")
        assert (
            again.code == 7
            and f"[h1] h1-tp8 (topology tp8, pid {pid}, scripts in {launch_dir}/tp8) is still running on h1"
            in again.stderr
        )
        r = ddeploy("stop", "--host", "h1")
        assert r.code == 0 and f"h1-tp8 (pid {pid}): terminated" in r.stderr
        assert _wait_for(lambda: not alive(pid), 5)
        assert follow.wait(timeout=15) == 0  # --follow ends with the server
        assert twin.poll() is None, "a process with the same command line was stopped too"
        r = ddeploy("stop", "--host", "h1")
        assert r.code == 7 and "nothing to stop: last launch tp8 was stopped at" in r.stderr
        assert "stand-in server" in ddeploy("logs", "--host", "h1").stdout  # the log outlives the server
    finally:
        for proc in (twin, follow):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop_kills_a_server_that_ignores_term_and_a_reused_pid_is_left_alone(ddeploy, hosts):
    h2 = hosts.host("h2")
    _launch_dir(h2)
    server = shlex.join([sys.executable, "-c", STUBBORN])
    r = ddeploy(
        "launch",
        "--host",
        "h2",
        "-t",
        "ep4",
        "--set",
        f"server_command={server}",
        "--set",
        "jit_cache_dir=/srv/jit cache",
    )
    assert r.code == 0, r.stderr
    record = _record(h2)
    pids = [u["pid"] for u in record["units"]]
    assert [u["name"] for u in record["units"]] == ["h2-ep4-r0", "h2-ep4-r1"] and all(map(alive, pids))
    environ = Path(f"/proc/{pids[1]}/environ").read_bytes().split(b"\0")
    assert {
        b"CUDA_VISIBLE_DEVICES=4,5,6,7",
        b"SGLANG_JIT_CACHE_DIR=/srv/jit cache",
        b"SGLANG_CRASH_ON_JIT_COMPILE=1",
    } <= set(environ)
    try:
        # a record whose start time does not match (pid reused by someone else) is never signalled
        forged = {**record, "units": [{**record["units"][0], "starttime": "1"}]}
        (_launches(h2) / "launch.json").write_text(json.dumps(forged))
        r = ddeploy("stop", "--host", "h2")
        assert r.code == 7 and "nothing to stop" in r.stderr and all(map(alive, pids))
        (_launches(h2) / "launch.json").write_text(json.dumps(record))
        r = ddeploy("stop", "--host", "h2", "--grace", "1")
        assert r.code == 0 and r.stderr.count(": killed") == 2, r.stderr
        assert _wait_for(lambda: not any(map(alive, pids)), 5)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_launch_dry_run_touches_nothing_and_logs_without_launch_is_a_clear_error(ddeploy, hosts):
    launch_dir = _launch_dir(hosts.host("h3"))
    r = ddeploy("launch", "--host", "h3", "-t", "tp8", "--dry-run")
    assert r.code == 0 and f"would copy h3-tp8.sh + h3-tp8.env to {launch_dir}/tp8/" in r.stderr
    assert not launch_dir.exists()
    r = ddeploy("logs", "--host", "h3")
    assert r.code == 7 and "nothing was launched here" in r.stderr


def test_a_server_that_exits_at_once_fails_the_launch_with_its_log(ddeploy, hosts):
    h3 = hosts.host("h3")
    _launch_dir(h3)
    crash = shlex.join([sys.executable, "-c", "import sys; print('bad flag --tp-sise'); sys.exit(3)"])
    r = ddeploy("launch", "--host", "h3", "-t", "tp8", "--set", f"server_command={crash}")
    assert r.code == 6 and "[h3] h3-tp8 exited right after start (the launch is stopped):" in r.stderr
    assert "bad flag --tp-sise" in r.stderr
    assert _record(h3)["units"][0]["name"] == "h3-tp8"
    r = ddeploy("stop", "--host", "h3")
    assert r.code == 7 and "last launch tp8 has exited" in r.stderr


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _applied(version: str) -> dict:
    return {"name": "ddtree", "version": version, "fingerprint": "f", "head": "h"}


def test_the_jit_cache_comes_from_a_good_build_of_the_applied_version():
    good = {"ok": True, "cache_dir": "/c/new", "version": "0.2.0", "at": "t2"}
    old = {"cache_dir": "/c/old", "version": "0.1.0", "at": "t1"}
    state = {"applied": _applied("0.2.0"), "builds": {"sm_120": {**good, "known": {"k1": old, "k2": good}}}}
    assert build_cache_dir(state, "sm_120") == ("/c/new", "build record sm_120, t2")
    failed = {
        "applied": _applied("0.1.0"),
        "builds": {"sm_120": {"ok": False, "cache_dir": "/c/x", "version": "0.1.0", "known": {"k1": old}}},
    }
    assert build_cache_dir(failed, "sm_120") == ("/c/old", "build record sm_120, t1")  # rolled back: old build reused
    assert build_cache_dir(state, "sm_103") == (None, "no kernel build recorded for sm_103")
    assert build_cache_dir({**state, "applied": _applied("0.3.0")}, "sm_120")[0] is None
    assert build_cache_dir({"applied": None}, "sm_120") == (None, "no patch set applied")


def test_an_unreadable_launch_record_is_an_error_not_nothing_launched(ddeploy, hosts):
    """A record that cannot be read (here a directory: root reads files of any mode) never reads as
    'nothing was launched', which would let launch start a second server beside the first."""
    h3 = hosts.host("h3")
    _launch_dir(h3)
    (_launches(h3) / "launch.json").mkdir(parents=True)
    try:
        for args in (("logs",), ("stop",), ("launch", "-t", "tp8")):
            r = ddeploy(*args, "--host", "h3")
            assert r.code == 7, r.stderr
            assert f"[h3] cannot read the launch record {_launches(h3) / 'launch.json'}" in r.stderr
    finally:
        shutil.rmtree(_launches(h3))


# A server that forks a worker into its session, as SGLang's launcher forks its schedulers.
FORKING = (
    "import subprocess, sys, time; "
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "print('worker', w.pid, flush=True); time.sleep(300)"
)
PID_SERVER = "import os, time; print('server pid', os.getpid(), flush=True); time.sleep(300)"


def _children(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and parent(int(name)) == pid:
                kids.append(int(name))
        except OSError:
            pass
    return kids


def test_a_second_launch_with_another_launch_dir_is_refused_and_stop_finds_the_first(ddeploy, hosts, tmp_path):
    """The lock and the record are the host's, not the launch dir's: `--set launch_dir=B` cannot
    start a second server on the GPUs that A's launch holds, and `stop`/`logs` without the --set
    find A's launch."""
    h1 = hosts.host("h1")
    _launch_dir(h1)
    a, b = tmp_path / "launch-a", tmp_path / "launch-b"
    server = shlex.join([sys.executable, "-c", STAND_IN])
    r = ddeploy("launch", "--host", "h1", "-t", "tp8", "--set", f"server_command={server}", "--set", f"launch_dir={a}")
    assert r.code == 0, r.stderr
    pid = _record(h1)["units"][0]["pid"]
    try:
        again = ddeploy(
            "launch", "--host", "h1", "-t", "tp8", "--set", f"server_command={server}", "--set", f"launch_dir={b}"
        )
        assert again.code == 7, again.stderr
        error = again.stderr.strip().splitlines()[-1]
        assert error == (
            f"ddeploy: error: [h1] h1-tp8 (topology tp8, pid {pid}, scripts in {a}/tp8) is still running on h1; "
            "run `ddeploy stop --host h1` first"
        )
        assert not (b / "tp8").exists() and _record(h1)["units"][0]["pid"] == pid
        assert _wait_for(lambda: "stand-in server" in ddeploy("logs", "--host", "h1").stdout)
        r = ddeploy("stop", "--host", "h1")
        assert r.code == 0 and f"h1-tp8 (pid {pid}): terminated" in r.stderr, r.stderr
        assert _wait_for(lambda: not alive(pid), 5)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        ddeploy("stop", "--host", "h1", "--grace", "1")  # a second launch, were it started


def test_a_record_an_older_agent_kept_in_the_launch_dir_is_adopted_by_stop(ddeploy, hosts):
    """Before the record moved to the host's cache it lived in `<launch_dir>/launch.json`: a server
    recorded there is still found (and stopped) by the new agent."""
    h3 = hosts.host("h3")
    launch_dir = _launch_dir(h3)
    launch_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        starttime = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        unit = {"name": "h3-tp8", "pid": proc.pid, "starttime": starttime, "log": str(launch_dir / "x.log")}
        old = {"id": "old-1", "topology": "tp8", "dir": str(launch_dir / "tp8"), "state": "running", "units": [unit]}
        (launch_dir / "launch.json").write_text(json.dumps(old))
        r = ddeploy("stop", "--host", "h3")
        assert r.code == 0 and f"h3-tp8 (pid {proc.pid}): terminated" in r.stderr, r.stderr
        assert proc.wait(5) is not None
        assert _record(h3)["id"] == "old-1" and _record(h3)["state"] == "stopped"
        assert not (launch_dir / "launch.json").exists() and (launch_dir / "launch.json.adopted").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workers_that_outlive_a_killed_leader_block_a_new_launch_and_stop_kills_them(ddeploy, hosts):
    """A scheduler whose launcher was SIGKILLed keeps its GPU memory: the unit still runs while any
    process of its session lives."""
    h2 = hosts.host("h2")
    _launch_dir(h2)
    server = shlex.join([sys.executable, "-c", FORKING])
    r = ddeploy("launch", "--host", "h2", "-t", "tp8", "--set", f"server_command={server}")
    assert r.code == 0, r.stderr
    leader = _record(h2)["units"][0]["pid"]
    assert _wait_for(lambda: len(_children(leader)) == 1)
    (worker,) = _children(leader)
    try:
        assert os.getsid(worker) == leader
        os.kill(leader, signal.SIGKILL)
        assert _wait_for(lambda: not alive(leader), 5) and alive(worker)
        again = ddeploy("launch", "--host", "h2", "-t", "tp8", "--set", f"server_command={server}")
        assert again.code == 7 and f"[h2] h2-tp8 (topology tp8, pid {leader}," in again.stderr, again.stderr
        assert "is still running on h2" in again.stderr
        r = ddeploy("stop", "--host", "h2", "--grace", "5")
        assert r.code == 0 and f"h2-tp8 (pid {leader}): terminated" in r.stderr, r.stderr
        assert _wait_for(lambda: not alive(worker), 5)
        assert _record(h2)["state"] == "stopped"
    finally:
        for pid in (leader, worker):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        ddeploy("stop", "--host", "h2", "--grace", "1")  # a second launch, were it started


def test_a_launch_whose_record_cannot_be_written_stops_what_it_started(hosts, tmp_path):
    """Another writer replaces the record while the unit starts (the compare-and-swap fails): the
    unit just started is stopped and the command fails naming the host; nothing runs unrecorded."""
    h1 = hosts.host("h1")
    launch_dir = _launch_dir(h1)
    server = shlex.join([sys.executable, "-c", PID_SERVER])
    argv = [sys.executable, "-c", CLI, "-i", str(hosts.inventory_dir), "launch", "--host", "h1", "-t", "tp8"]
    env = {**os.environ, "DDEPLOY_TEST_AGENT_PAUSE": "launch_unit_started:3"}
    proc = subprocess.Popen(
        [*argv, "--set", f"server_command={server}"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    log = launch_dir / "tp8" / "h1-tp8.log"
    pid = None
    try:
        assert _wait_for(lambda: log.exists() and "server pid" in log.read_text(), 30)
        pid = int(log.read_text().split("server pid ")[1].split()[0])
        other = {"id": "someone-else", "topology": "tp8", "dir": str(tmp_path), "state": "stopped", "units": []}
        (_launches(h1) / "launch.json").write_text(json.dumps(other))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 7, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("ddeploy: error: [h1] the launch record ") and "could not be written" in line, line
        assert "so the tp8 launch was stopped" in line and "changed under this operation" in line
        assert not alive(pid)
        assert _record(h1)["id"] == "someone-else"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
