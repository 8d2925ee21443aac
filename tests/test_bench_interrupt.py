"""`ddeploy bench --compare` interrupted at each of its phases, on an OpenSSH test host and on the
`local` host: afterwards the original launch serves again, is recorded, and `stop` stops it;
nothing the bench started is left running. SGLang's server and benchmark client are the
stand-ins of tests/standin_sglang (a real server takes a minute to start; test_serving.py runs
the real one).

Ctrl-C is SIGINT to the client's whole process group, as a terminal sends it; a cut link is the
client killed outright (SIGKILL): the host restores the launch on its own in both cases.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from processes import alive, free_port, wait_until

pytestmark = pytest.mark.sshd

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = Path(__file__).resolve().parent / "standin_sglang"
BENCH = ("--requests", "1", "--concurrency", "1", "--input-len", "4", "--output-len", "4")
# The client as a terminal's foreground job runs it: Python's own SIGINT handler installed even where
# the suite itself was started with SIGINT ignored (a `nohup ... &` from a shell without job control,
# whose children would inherit the ignore and never see the Ctrl-C these tests send).
CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from deployer.cli import main; sys.exit(main(sys.argv[1:]))"
)
# phase -> (the stand-in marker that shows the phase runs, STANDIN_SLOW that makes it last)
PHASES = {
    "first measurement": ("client-ddtree-", "client-ddtree"),
    "baseline start": ("server-linear-", "server-linear"),
    "baseline measurement": ("client-linear-", "client-linear"),
    "restore": ("server-ddtree-", "server-ddtree-again"),
}


def _launch_args(host: str, marks: Path, slow: str, port: int) -> list[str]:
    server = shlex.join([sys.executable, str(STAND_IN / "server.py")])
    sets = {
        "tp_size": "1" if host == "local" else "8",  # the local host has one (pretend) GPU
        "server_command": server,
        "port": str(port),
        "listen_host": "127.0.0.1",
        "env.PYTHONPATH": str(STAND_IN),
        "env.STANDIN_MARKS": str(marks),
        "env.STANDIN_SLOW": slow,
    }
    args = ["launch", "--host", host, "-t", "tp8", "--wait", "--wait-timeout", "60"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def launches_dir(hosts, name: str, cache: Path | None = None) -> Path:
    """Where the agent keeps a host's launch record and lock: `launches/` in the host's
    DDEPLOY_CACHE_DIR (the session's cache for `local`, the sshd host's own for the others)."""
    return (cache if name == "local" else hosts.host(name).cache_dir) / "launches"


def read_record(launches: Path) -> dict:
    return json.loads((launches / "launch.json").read_text())


def _lock_free(launches: Path) -> bool:
    """Nothing holds the host's launch lock: no launch, wait, bench or stop is at work there."""
    if not (launches / "launch.lock").exists():
        return True
    fd = os.open(launches / "launch.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _healthy_config(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=5) as resp:  # noqa: S310 - loopback
            info = json.loads(resp.read())
    except OSError:
        return None
    return "ddtree" if info.get("speculative_dflash_tree_budget") else "other"


def _marked(marks: Path, prefix: str, count: int = 1) -> bool:
    return sum(1 for f in marks.iterdir() if f.name.startswith(prefix)) >= count


def _stand_in_pids(marks: Path) -> list[int]:
    return [int(f.read_text()) for f in marks.iterdir() if f.read_text().strip()]


@pytest.fixture
def marks(hosts, cli, tmp_path):
    """The stand-ins' marks dir for a test on h1 (the stand-in tests import it); afterwards h1's
    launch is stopped and no stand-in is left."""
    marks = tmp_path / "marks"
    marks.mkdir()
    yield marks
    cli("stop", "--host", "h1", "--grace", "2", inventory=hosts.inventory_dir)
    for pid in _stand_in_pids(marks):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _interrupt_bench(inventory, host, marks, phase, sig) -> tuple[int, str]:
    """Run `bench --compare` as its own process, send `sig` to its group once `phase` runs; (rc, stderr)."""
    marker, _ = PHASES[phase]
    count = 2 if phase == "restore" else 1
    argv = [sys.executable, "-c", CLI, "-i", str(inventory), "bench", "--host", host, "-t", "tp8", *BENCH]
    argv += ["--compare", "linear", "--yes", "--wait-timeout", "60"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: _marked(marks, marker, count), 60), f"{phase} never began"
        time.sleep(0.3)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err.decode()


# Ctrl-C at every phase on both hosts; a cut link (the client killed) at the two phases where the
# host has the most to undo.
CASES = [(host, "ctrl-c", phase) for host in ("h1", "local") for phase in PHASES]
CASES += [("h1", "cut", "baseline measurement"), ("local", "cut", "baseline start")]


@pytest.fixture
def bench_host(request, hosts, cli, _isolated_cache, tmp_path):
    """(host name, its launches dir (record and lock), the marks dir) for the stand-in launches."""
    name = request.param
    if name == "local":
        checkout = _isolated_cache / "local" / "sglang"
        checkout.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    launch_dir = launches_dir(hosts, name, _isolated_cache)
    marks = tmp_path / "marks"
    marks.mkdir()
    yield name, launch_dir, marks
    # whatever a failing test left: stop it, then make sure nothing of the stand-ins runs
    wait_until(lambda: _lock_free(launch_dir), 60)
    cli("stop", "--host", name, "--grace", "2", inventory=hosts.inventory_dir)
    for pid in _stand_in_pids(marks):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("bench_host", "how", "phase"), CASES, indirect=["bench_host"])
def test_bench_compare_interrupted_leaves_the_original_serving_and_recorded(bench_host, hosts, cli, phase, how):
    name, launch_dir, marks = bench_host
    port = free_port()
    r = cli(*_launch_args(name, marks, PHASES[phase][1], port), inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr
    original = read_record(launch_dir)
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGKILL
    rc, err = _interrupt_bench(hosts.inventory_dir, name, marks, phase, sig)
    assert rc == (130 if how == "ctrl-c" else -signal.SIGKILL), err
    # the host finishes on its own: the baseline stopped, the original started again and serving
    assert wait_until(lambda: _lock_free(launch_dir), 90), "the host's bench never ended"
    record = read_record(launch_dir)
    assert record["topology"] == "tp8" and record.get("variant") is None and record["state"] == "running", record
    assert record["dir"] == original["dir"]
    (unit,) = record["units"]
    assert alive(unit["pid"])
    assert _healthy_config(f"http://127.0.0.1:{port}") == "ddtree"
    # nothing but the original's server runs of what the stand-ins started
    running = [pid for pid in _stand_in_pids(marks) if alive(pid)]
    assert len(running) == 1, running
    stopped = cli("stop", "--host", name, "--grace", "5", inventory=hosts.inventory_dir)
    assert stopped.code == 0, stopped.stderr
    assert wait_until(lambda: not any(alive(pid) for pid in _stand_in_pids(marks)), 10)
