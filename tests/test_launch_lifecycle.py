"""Launches that never lose track of a server, on OpenSSH test hosts with the SGLang stand-ins of
tests/standin_sglang: a start that fails stops everything it started (every unit, every host),
a wait whose client has gone ends and stops what it started, a second command waits for the
launch lock and names its holder, the benchmark client's run timeout applies, and the launch
record is replaced only by compare-and-swap."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import alive, free_port, wait_until
from test_bench_interrupt import CLI, ROOT, _launch_args, _lock_free, _stand_in_pids, launches_dir

pytestmark = pytest.mark.sshd


@pytest.fixture
def stand_in(hosts, tmp_path):
    """The marks dir; afterwards every stand-in process still alive is killed (a failing test)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    yield marks
    for pid in _stand_in_pids(marks):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _launch_dir(hosts, name: str) -> Path:
    """The host's launches dir: its launch record and lock (not the launch_dir of the scripts)."""
    return launches_dir(hosts, name)


def _record(launches: Path) -> dict:
    return json.loads((launches / "launch.json").read_text())


def _with(args: list[str], **sets: str) -> list[str]:
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


@pytest.mark.parametrize("wait", [True, False])
def test_a_replica_that_exits_at_start_stops_the_other(ddeploy, hosts, stand_in, wait):
    port = free_port()
    args = _launch_args("h1", stand_in, "", port)
    args = [a for a in args if a not in ("--wait",)] + (["--wait"] if wait else [])
    args = _with(args, tp_size="4", model_weights_gb="10", **{"env.STANDIN_EXIT_PORT": str(port + 1)})
    args[args.index("tp8")] = "ep4"
    r = ddeploy(*args)
    record = _record(_launch_dir(hosts, "h1"))
    assert len(record["units"]) == 2 and not any(alive(u["pid"]) for u in record["units"]), r.stderr
    assert r.code != 0 and "exited right after start (the launch is stopped)" in r.stderr, r.stderr
    assert record["state"] == "failed"


@pytest.mark.parametrize("wait", [False, True])
def test_a_two_node_start_refused_on_the_second_host_stops_the_first(ddeploy, hosts, stand_in, wait):
    """Without --wait the first host's launch is stopped by the command; with it, the first host
    is still waiting (its server is slow to serve) when the second is refused: its operation is
    cut and its agent stops what it started."""
    old_port, port = free_port(), free_port()
    old = ddeploy(*_launch_args("h3", stand_in, "", old_port))
    assert old.code == 0, old.stderr
    old_pid = _record(_launch_dir(hosts, "h3"))["units"][0]["pid"]
    args = _with(_launch_args("h1", stand_in, "server-ddtree", port), **{"env.STANDIN_DELAY": "30"})
    args[args.index("--host") + 1 : args.index("--host") + 2] = ["h1", "--host", "h3"]
    args[args.index("tp8")] = "tp16-2node"
    args = [a for a in args if a != "--wait"] + (["--wait"] if wait else [])
    args[args.index("tp_size=8")] = "tp_size=16"
    r = ddeploy(*args)
    assert r.code != 0 and "[h3]" in r.stderr and "still running" in r.stderr, r.stderr
    assert wait_until(lambda: _lock_free(_launch_dir(hosts, "h1")), 20)
    assert [pid for pid in _stand_in_pids(stand_in) if alive(pid)] == [old_pid]  # h3's older launch only
    first = _record(_launch_dir(hosts, "h1"))
    if str(stand_in) in " ".join(first.get("sets", [])):  # h1 got as far as starting (with --wait it may not)
        assert first["state"] == "stopped" and not any(alive(u["pid"]) for u in first["units"]), first
        # --wait: h1's own agent stopped it when its operation was cut
        assert ("client went away" in (first.get("failure") or "")) == wait, first
    else:
        assert wait, "without --wait h1 starts before h3 is asked"
    assert alive(old_pid), "the old launch on h3 is not this command's to stop"
    assert ddeploy("stop", "--host", "h3").code == 0


def test_a_launch_wait_whose_client_dies_stops_what_it_started(hosts, stand_in):
    port = free_port()
    launch_dir = _launch_dir(hosts, "h1")
    args = _with(_launch_args("h1", stand_in, "server-ddtree", port), **{"env.STANDIN_DELAY": "30"})
    argv = [sys.executable, "-c", CLI, "-i", str(hosts.inventory_dir), *args]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    assert wait_until(lambda: any(f.name.startswith("server-ddtree-") for f in stand_in.iterdir()), 60)
    os.killpg(proc.pid, signal.SIGKILL)  # the client machine's link is gone
    proc.wait()
    assert wait_until(lambda: _lock_free(launch_dir), 20), "the host's wait went on without its client"
    record = _record(launch_dir)
    assert record["state"] == "stopped" and "client went away" in record["failure"], record
    assert not any(alive(pid) for pid in _stand_in_pids(stand_in))


def test_a_second_command_waits_for_the_launch_lock_then_names_its_holder(ddeploy, hosts, stand_in):
    port = free_port()
    launch_dir = _launch_dir(hosts, "h1")
    args = _with(_launch_args("h1", stand_in, "server-ddtree", port), **{"env.STANDIN_DELAY": "40"})
    argv = [sys.executable, "-c", CLI, "-i", str(hosts.inventory_dir), *args]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: any(f.name.startswith("server-ddtree-") for f in stand_in.iterdir()), 60)
        started = time.monotonic()
        r = ddeploy("stop", "--host", "h1")
        assert time.monotonic() - started >= 4, "it did not wait for the holder"
        assert r.code != 0 and "are busy: `ddeploy" in r.stderr and "launch --host h1" in r.stderr, r.stderr
        assert alive(_record(launch_dir)["units"][0]["pid"])  # nothing stopped under the launch
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    assert wait_until(lambda: _lock_free(launch_dir), 20)
    assert _record(launch_dir)["state"] == "stopped"


def test_the_benchmark_clients_run_timeout_stops_it_on_the_host(ddeploy, hosts, stand_in):
    port = free_port()
    assert ddeploy(*_launch_args("h1", stand_in, "client-ddtree", port)).code == 0
    r = ddeploy("bench", "--host", "h1", "-n", "1", "-c", "1", "--input-len", "4", "--output-len", "4",
                "--run-timeout", "2")  # fmt: skip
    assert r.code != 0 and "ran past the run timeout (2 s)" in r.stderr, r.stderr
    clients = [int(f.read_text()) for f in stand_in.iterdir() if f.name.startswith("client-")]
    assert clients and not any(alive(pid) for pid in clients)
    record = _record(_launch_dir(hosts, "h1"))
    assert record["state"] == "running" and alive(record["units"][0]["pid"])  # the server serves on
    assert ddeploy("stop", "--host", "h1").code == 0


def test_a_launch_record_is_replaced_only_by_compare_and_swap(tmp_path, monkeypatch):
    from deployer.agent.common import Fail
    from deployer.agent.launch_record import read_launch, write_launch

    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path))
    write_launch({"id": "new", "topology": "tp8"})
    with pytest.raises(Fail, match="changed under this operation"):
        write_launch({"id": "old", "topology": "tp8", "state": "running"}, replaces="old")
    assert read_launch() == {"id": "new", "topology": "tp8"}
    assert (tmp_path / "launches" / "launch.json").is_file()


def test_a_failed_restore_keeps_the_first_cause_and_says_what_the_host_serves(ddeploy, hosts, stand_in):
    """The linear baseline exits at start, and so does the launch when it is started again: the
    error names both, and says that nothing serves now; nothing is left running."""
    port = free_port()
    fail = "server-linear server-ddtree-again"
    assert ddeploy(*_with(_launch_args("h1", stand_in, "", port), **{"env.STANDIN_FAIL": fail})).code == 0
    r = ddeploy("bench", "--host", "h1", "-n", "1", "-c", "1", "--input-len", "4", "--output-len", "4",
                "--compare", "linear", "--yes")  # fmt: skip
    err = r.stderr.strip().splitlines()[-1]
    assert r.code != 0 and err.startswith("ddeploy: error: [h1] restoring tp8 failed: h1-tp8 exited right after start")
    assert "; what failed first: h1-tp8 exited right after start" in err and "(linear): told to exit" in err
    assert "the host now serves nothing (`ddeploy launch --host h1 --topology tp8 --wait`" in err, err
    assert not any(alive(pid) for pid in _stand_in_pids(stand_in))
    assert _record(_launch_dir(hosts, "h1"))["state"] == "failed"


def test_the_bench_deadline_bounds_the_greedy_probes_and_the_launch_serves_again(ddeploy, hosts, stand_in):
    """The linear baseline's /generate stalls (60 s per probe): past --timeout the probes end, the
    baseline is stopped, the DDTree launch serves again, recorded, and bench fails in one line."""
    port = free_port()
    args = _with(_launch_args("h1", stand_in, "", port), **{"env.STANDIN_SLOW_GENERATE": "linear"})
    assert ddeploy(*args).code == 0
    started = time.monotonic()
    r = ddeploy("bench", "--host", "h1", "-n", "1", "-c", "1", "--input-len", "4", "--output-len", "4",
                "--compare", "linear", "--yes", "--timeout", "12")  # fmt: skip
    assert time.monotonic() - started < 40, "the deadline did not bound the probes"
    err = r.stderr.strip().splitlines()[-1]
    assert r.code == 6 and "[h1] the benchmark ran past its deadline (12 s, --timeout) during the greedy probes" in err
    record = _record(_launch_dir(hosts, "h1"))
    assert record["state"] == "running" and record.get("variant") is None, record
    assert [pid for pid in _stand_in_pids(stand_in) if alive(pid)] == [record["units"][0]["pid"]]
    assert ddeploy("stop", "--host", "h1").code == 0


# A server that only marks its start (no HTTP: a launch without --wait never asks it anything).
MARKING = (
    "import os, time; open(os.path.join(%r, 'server-%%d' %% os.getpid()), 'w').write(str(os.getpid())); time.sleep(300)"
)


def test_ctrl_c_while_a_hosts_start_is_in_flight_leaves_no_host_serving_unrecorded(ddeploy, hosts, stand_in):
    """Ctrl-C during a two-host launch without --wait, while the second host's start is in flight
    (its unit started, not yet recorded): that host goes back to what it served (nothing, recorded
    stopped), and whatever still runs anywhere is recorded running and `stop` stops it."""
    server = shlex.join([sys.executable, "-c", MARKING % str(stand_in)])
    args = ["launch", "--host", "h1", "--host", "h3", "-t", "tp16-2node", "--set", f"server_command={server}"]
    env = {**os.environ, "DDEPLOY_TEST_AGENT_PAUSE": "launch_unit_started:4"}
    argv = [sys.executable, "-c", CLI, "-i", str(hosts.inventory_dir), *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: len(_stand_in_pids(stand_in)) == 2, 60), "h3's start never began"
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C, while h3's agent is yet to record its unit
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    for name in ("h1", "h3"):
        assert wait_until(lambda n=name: _lock_free(_launch_dir(hosts, n)), 30), f"{name}'s launch never ended"
    h3 = _record(_launch_dir(hosts, "h3"))
    (second,) = [u["pid"] for u in h3["units"]]
    (first,) = [pid for pid in _stand_in_pids(stand_in) if pid != second]  # h1's unit
    assert h3["state"] == "stopped", h3
    assert "client went away before the launch was reported" in h3["failure"]
    assert wait_until(lambda: not alive(second), 5)
    h1 = _record(_launch_dir(hosts, "h1"))
    if alive(first):  # the command could not stop it: then it is recorded, and stop finds it
        assert h1["state"] == "running" and h1["units"][0]["pid"] == first, h1
        assert ddeploy("stop", "--host", "h1").code == 0
    else:
        assert h1["state"] == "stopped", h1
    assert not any(alive(pid) for pid in _stand_in_pids(stand_in))
