"""Kept connections (deployer/transport/control.py) against real sshd hosts: a later command uses
the first one's connection, behaves as over its own, and never outlives a check a fresh connect
would fail. The rest of the suite runs with reuse off (conftest.py), so each of its tests sees its
own command's connection."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deployer.errors import ConnectError, RemoteCommandError
from deployer.inventory import Inventory
from deployer.transport import control
from deployer.transport.connection import open_connection
from processes import parent, wait_until
from sshd_hosts import _sshd_descendants

pytestmark = pytest.mark.sshd
MASTER = "deployer.transport.control_master"


@pytest.fixture
def kept(hosts, monkeypatch):
    """Reuse on (60 s), in a socket directory of this test's own; every master gone afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="ddc-", dir="/tmp")) / "control"
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "60")
    monkeypatch.setenv("DDEPLOY_CONTROL_DIR", str(directory))
    yield directory
    try:
        if directory.is_dir():
            directory.chmod(0o700)  # a test made it public
        control.disconnect()
        _wait(lambda: not _masters(directory), "the masters to exit")
    finally:
        for pid in _masters(directory):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory.parent, ignore_errors=True)


def _masters(directory: Path) -> list[int]:
    """The connection masters serving `directory`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if MASTER.encode() in cmdline and f"DDEPLOY_CONTROL_DIR={directory}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _wait(done, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _host(fleet, name):
    return Inventory.load(fleet.inventory_dir).get(name)


def _stop_listener(sshd_host) -> None:
    """The host's sshd stops accepting; the sessions it already has keep running."""
    os.kill(sshd_host.proc.pid, signal.SIGKILL)
    sshd_host.proc.wait()
    sshd_host.proc = None


def test_a_later_command_runs_over_the_first_ones_connection(hosts, kept, ddeploy, patch_sets, monkeypatch):
    first = ddeploy("push", "--version", str(patch_sets["v2"]), "--host", "h1")
    assert first.code == 0, first.stderr
    assert "[h1] shipping" in first.stderr  # progress lines come through the master as they happen
    assert len(list(kept.glob("*.sock"))) == 1 and len(_masters(kept)) == 1
    assert stat.S_IMODE(kept.stat().st_mode) == 0o700
    _stop_listener(hosts.host("h1"))  # a new connect is now refused: only the kept one can work
    try:
        again = ddeploy("push", "--version", str(patch_sets["v2"]), "--host", "h1")
        assert again.code == 0, again.stderr
        assert "already applied" in again.stderr
        status = ddeploy("status", "--host", "h1", "--json")
        assert status.code == 0 and '"version": "0.2.0"' in status.stdout
        monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "0")  # control: a command's own connect fails
        own = ddeploy("status", "--host", "h1")
        assert own.code != 0 and "refused" in own.stderr
    finally:
        hosts.host("h1").start()


def test_commands_behave_as_over_their_own_connection(hosts, kept):
    h1 = hosts.hosts[0]
    with open_connection(_host(hosts, "h1")) as conn:
        assert isinstance(conn, control.SharedConnection)
        assert conn.run(["printf", "%s|", "a b", "$HOME", "`id`", "x;y"]).stdout == "a b|$HOME|`id`|x;y|"
        assert conn.run(["sh", "-c", "echo $DDEPLOY_TEST_HOST"]).stdout.strip() == "h1"
        assert conn.run(["pwd"], cwd=str(h1.checkout)).stdout.strip() == str(h1.checkout)
        assert conn.run(["cat"], input=b"through stdin").stdout == "through stdin"
        with pytest.raises(RemoteCommandError, match=r"\[h1\].*exited 3"):
            conn.run(["sh", "-c", "exit 3"])
        lines: list[str] = []
        conn.run(["sh", "-c", "echo one >&2; echo two >&2"], stream=lines.append)
        assert lines == ["one", "two"]
        killed = conn.run(["sh", "-c", "echo going >&2; kill -TERM $$"], check=False)
        assert (killed.signal, killed.rc, killed.stderr) == ("TERM", 143, "going\n")
        with pytest.raises(RemoteCommandError, match="timed out after 0.5s"):
            conn.run(["sleep", "5"], timeout=0.5)
        started = conn.start(["cat"], first_input=b"first ")
        assert started.finish(b"rest").stdout == "first rest"


def test_a_client_that_goes_away_ends_its_remote_command(hosts, kept, tmp_path):
    """Ctrl-C or a killed client: the master closes the command's channel, so the command sees
    the end of its stdin (the agent then stops), as over a cut link."""
    marker = hosts.hosts[0].root / "client-gone"
    marker.unlink(missing_ok=True)
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from deployer.inventory import Inventory
from deployer.transport.agent_client import agent_session
from deployer.transport.connection import open_connection
from deployer.transport.protocol import StatusReply
from processes import logging_python, running, starts
host = Inventory.load({str(hosts.inventory_dir)!r}).get("h1")
conn = open_connection(host)
started = conn.start(["sh", "-c", "cat >/dev/null; touch {marker}"], hold_stdin=True)
print("started", flush=True)
started.finish(b"")  # stdin held open: waits until killed
"""
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert client.stdout.readline().strip() == "started"
    time.sleep(0.5)
    assert not marker.exists()  # stdin is held: the remote command still waits
    client.kill()
    client.wait()
    _wait(marker.exists, "the remote command to see the end of its stdin")
    with open_connection(_host(hosts, "h1")) as conn:  # the kept connection serves on
        assert conn.run(["true"]).rc == 0
    assert len(_masters(kept)) == 1


def test_a_key_no_longer_trusted_is_refused_not_reused(hosts, kept, ddeploy):
    assert ddeploy("status", "--host", "h1").code == 0  # kept
    hosts.forget_host_key(hosts.host("h1"))
    status = ddeploy("status", "--host", "h1")
    assert status.code != 0
    assert "not in known_hosts" in status.stderr
    _wait(lambda: not list(kept.glob("*.sock")), "the stale connection to close")
    hosts.write_known_hosts()
    assert ddeploy("status", "--host", "h1").code == 0


def test_a_failed_connect_leaves_nothing_running(hosts, kept, ddeploy, monkeypatch):
    hosts.forget_host_key(hosts.host("h2"))
    shared = ddeploy("status", "--host", "h2")
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "0")
    own = ddeploy("status", "--host", "h2")
    assert shared.code == own.code != 0

    def lines(stderr: str) -> list[str]:  # the error lines, without the time each took
        return [re.sub(r" in \d+\.\d+s", "", ln) for ln in stderr.splitlines() if "known_hosts" in ln]

    assert lines(shared.stderr) and lines(shared.stderr) == lines(own.stderr)
    _wait(lambda: not _masters(kept), "the master to exit")
    assert not list(kept.glob("*.sock"))


def test_one_master_connects_every_host_of_a_command(hosts, kept, ddeploy, patch_sets):
    res = ddeploy("push", "--version", str(patch_sets["v2"]), "--host", "h1", "--host", "h2", "--host", "h3")
    assert res.code == 0, res.stderr
    assert len(list(kept.glob("*.sock"))) == 3 and len(_masters(kept)) == 1
    closed = ddeploy("disconnect", "--host", "h2")
    assert closed.code == 0 and "closed the kept connection to h2" in closed.stderr
    assert len(list(kept.glob("*.sock"))) == 2
    assert "no kept connection" in ddeploy("disconnect", "--host", "h2").stderr
    everything = ddeploy("disconnect")
    assert everything.code == 0 and "h1" in everything.stderr and "h3" in everything.stderr
    _wait(lambda: not _masters(kept), "the master to exit after its last host")
    assert not list(kept.glob("*.sock"))


def test_disconnect_removes_the_socket_a_killed_master_left(hosts, kept, ddeploy):
    assert ddeploy("status", "--host", "h1").code == 0
    [master] = _masters(kept)
    os.kill(master, signal.SIGKILL)
    _wait(lambda: not _masters(kept), "the killed master to go")
    [left] = kept.glob("*.sock")  # no master listens on it any more
    res = ddeploy("disconnect")
    assert res.code == 0 and "no kept connection was open" in res.stderr
    assert not left.exists()
    assert ddeploy("status", "--host", "h1").code == 0  # the next command starts a master anew
    assert len(list(kept.glob("*.sock"))) == 1 and len(_masters(kept)) == 1


def test_an_idle_connection_closes_after_the_persist_time(hosts, kept, ddeploy, monkeypatch):
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "1")
    assert ddeploy("status", "--host", "h3").code == 0
    assert _masters(kept)
    _wait(lambda: not _masters(kept) and not list(kept.glob("*.sock")), "the idle master to exit", timeout=8)


def test_a_socket_directory_others_can_use_is_refused(hosts, kept, ddeploy):
    kept.mkdir(mode=0o700)
    kept.chmod(0o755)
    res = ddeploy("status", "--host", "h1")
    assert res.code != 0
    assert f"the connection directory {kept} is not private to this user" in res.stderr
    assert "mode 755" in res.stderr and not _masters(kept)


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1e9"])
def test_a_bad_persist_setting_is_one_line(hosts, kept, ddeploy, monkeypatch, value):
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", value)
    res = ddeploy("status", "--host", "h1")
    assert res.code != 0
    assert f"DDEPLOY_CONTROL_PERSIST={value!r} is not a number of seconds" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3 and "Traceback" not in res.stderr


def test_a_changed_inventory_entry_is_another_connection(hosts):
    h1 = _host(hosts, "h1")
    moved = h1.model_copy(update={"ssh": h1.ssh.model_copy(update={"port": 2222})})
    assert control.connection_name(h1) != control.connection_name(moved)
    assert control.connection_name(h1) == control.connection_name(_host(hosts, "h1"))


def test_a_command_with_accept_new_host_keys_connects_itself(hosts, kept):
    conn = control.Connector([_host(hosts, "h1")], accept_new_host_keys=True).open(_host(hosts, "h1"))
    with conn:
        assert not isinstance(conn, control.SharedConnection)
    assert not _masters(kept)


def test_connect_errors_through_the_master_keep_their_kind(hosts, kept):
    hosts.forget_host_key(hosts.host("h3"))
    with pytest.raises(ConnectError, match=r"^\[h3\] .*not in known_hosts"):
        open_connection(_host(hosts, "h3"))


def test_closing_the_connection_cuts_its_running_commands(hosts, kept):
    """As closing a command's own connection does (a fleet command cutting a host's operation):
    the waiting `finish` fails as a lost connection and the remote command sees its stdin end."""
    import threading

    marker = hosts.hosts[0].root / "cut"
    marker.unlink(missing_ok=True)
    conn = open_connection(_host(hosts, "h1"))
    started = conn.start(["sh", "-c", f"cat >/dev/null; touch {marker}"], hold_stdin=True)
    threading.Timer(0.5, conn.close).start()
    with pytest.raises(ConnectError, match=r"^\[h1\] connection lost while running sh"):
        started.finish(b"")
    _wait(marker.exists, "the cut command to see the end of its stdin")
    with open_connection(_host(hosts, "h1")) as again:  # the kept connection itself stays
        assert again.run(["true"]).rc == 0


def test_each_command_keeps_its_own_time_limit(hosts, kept, monkeypatch):
    """The command that started the master had DDEPLOY_COMMAND_TIMEOUT=0.5; a later one has none."""
    monkeypatch.setenv("DDEPLOY_COMMAND_TIMEOUT", "0.5")
    with open_connection(_host(hosts, "h2")) as conn, pytest.raises(RemoteCommandError, match="after 0.5s"):
        conn.run(["sleep", "2"])
    monkeypatch.delenv("DDEPLOY_COMMAND_TIMEOUT")
    with open_connection(_host(hosts, "h2")) as conn:
        assert conn.run(["sh", "-c", "sleep 1; echo slept"]).stdout == "slept\n"
    assert len(_masters(kept)) == 1


def test_a_command_mixing_kept_and_new_connections_waits_only_for_the_new(hosts, kept, ddeploy):
    """h1 is kept; h2 and h3 are not, and h3 is down: h1 is served at once, h2 connects, h3 fails."""
    assert ddeploy("status", "--host", "h1").code == 0
    hosts.hosts[2].stop()
    res = ddeploy("status", "--all", "--json")
    assert res.code == 5, res.stderr
    import json

    results = {x["host"]: x for x in json.loads(res.stdout)}
    assert [results[h]["ok"] for h in ("h1", "h2", "h3")] == [True, True, False]
    assert "unreachable" in results["h3"]["error"]["message"]
    assert results["h1"]["duration_s"] < 5
    assert len(_masters(kept)) == 2 and len(list(kept.glob("*.sock"))) == 2


# ---------------------------------------------------------------- nothing left on a host
def _commands_under_sshd(sshd_host) -> list[int]:
    """The processes that the host's sshd sessions run (a command, an agent): none but sshd's own."""
    sessions = set(_sshd_descendants(sshd_host.proc.pid))
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and parent(int(entry.name)) in sessions:
                if not (entry / "comm").read_text().startswith("sshd"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_no_process_is_left_on_a_host_after_a_command(hosts, kept, ddeploy):
    """OpenSSH's ControlPersist keeps a socket, not a process: after `status` over a kept
    connection, the host's sshd runs its session and nothing under it (no agent waiting)."""
    h1 = hosts.host("h1")
    assert ddeploy("status", "--host", "h1").code == 0
    assert len(_masters(kept)) == 1 and _sshd_descendants(h1.proc.pid)  # the connection is kept
    assert not wait_until(lambda: _commands_under_sshd(h1), limit=2.0)
    assert ddeploy("status", "--host", "h1").code == 0  # and serves the next command
    assert not wait_until(lambda: _commands_under_sshd(h1), limit=2.0)


# ---------------------------------------------------------------- disconnect, as `ssh -O stop`
def test_disconnect_lets_a_running_command_finish_and_later_commands_connect_anew(hosts, kept, ddeploy, tmp_path):
    import threading

    go = tmp_path / "go"
    script = f"echo waiting >&2; while [ ! -e {go} ]; do sleep 0.05; done; echo finished"
    lines: list[str] = []
    results = []
    conn = open_connection(_host(hosts, "h1"))
    running = threading.Thread(target=lambda: results.append(conn.run(["sh", "-c", script], stream=lines.append)))
    running.start()
    try:
        _wait(lambda: lines == ["waiting"], "the long command to run on the kept connection")
        [first] = _masters(kept)
        stopped = ddeploy("disconnect")
        assert stopped.code == 0
        assert "closed the kept connection to h1 (closes when its 1 running command(s) end)" in stopped.stderr
        assert not list(kept.glob("*.sock"))  # it takes no new command ...
        later = ddeploy("status", "--host", "h1")  # ... a new one starts a new master
        assert later.code == 0, later.stderr
        assert first in _masters(kept) and len(_masters(kept)) == 2
    finally:
        go.touch()
        running.join(30)
    assert [r.stdout for r in results] == ["finished\n"]  # the running command was not cut
    _wait(lambda: first not in _masters(kept), "the stopped master to exit after its command")
    assert ddeploy("status", "--host", "h1").code == 0 and len(list(kept.glob("*.sock"))) == 1


# ---------------------------------------------------------------- who may use a master
def test_a_platform_without_peer_credentials_still_serves_its_user(hosts, kept, monkeypatch):
    """No SO_PEERCRED (as on macOS): the master relies on the socket directory's 0700 mode and
    serves its user, and its accept thread goes on to the next client."""
    import socket

    from deployer.transport.control_master import KeptHost
    from deployer.transport.endpoint import SSHEndpoint
    from deployer.transport.ssh_connection import SSHConnection
    from deployer.transport.timeouts import Timeouts

    monkeypatch.delattr(socket, "SO_PEERCRED")
    host, timeouts = _host(hosts, "h1"), Timeouts.from_env()
    path = control.socket_in(control.control_dir(), host)
    endpoint = SSHEndpoint.of(host)
    master = KeptHost(endpoint, path, SSHConnection(endpoint, timeouts=timeouts), persist=60)
    master.serve()
    socket.setdefaulttimeout(10)  # a client never served fails, rather than waits for ever
    try:
        conn = control.SharedConnection(host, path, timeouts, reopen=lambda: pytest.fail("the master closed"))
        assert conn.run(["echo", "served"]).stdout == "served\n"
        assert conn.run(["echo", "again"]).stdout == "again\n"
    finally:
        socket.setdefaulttimeout(None)
        master.close()


# ---------------------------------------------------------------- how the master starts
def _python_without_deployer(tmp_path) -> tuple[str, dict[str, str]]:
    """The base interpreter and an environment in which deployer imports only through PYTHONPATH
    (a copy of the package; its dependencies from the project's venv), as after `pip install
    --target` or in a PYTHONPATH / zipapp setup: not installed anywhere the interpreter looks."""
    import site

    copy = tmp_path / "pythonpath"
    shutil.copytree(Path(control.__file__).parents[1], copy / "deployer", ignore=shutil.ignore_patterns("__pycache__"))
    deps = [p for p in site.getsitepackages() if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), *deps])}
    return getattr(sys, "_base_executable", sys.executable), env


def test_a_master_imports_deployer_as_the_client_did(hosts, kept, tmp_path):
    """deployer only on PYTHONPATH: the master still starts, the command succeeds through it, and
    the connection is kept for the next command."""
    python, env = _python_without_deployer(tmp_path)
    probe = subprocess.run([python, "-c", "import deployer"], env={**env, "PYTHONPATH": ""}, cwd=tmp_path)
    assert probe.returncode != 0  # the scenario: nothing but PYTHONPATH finds deployer
    argv = [python, "-c", "from deployer.cli import main; main()", "-i", str(hosts.inventory_dir)]
    res = subprocess.run([*argv, "status", "--host", "h1"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "connecting directly" not in res.stderr  # served by a master, not by the fallback
    assert len(_masters(kept)) == 1 and len(list(kept.glob("*.sock"))) == 1


def test_a_master_that_ends_before_connecting_leaves_the_command_to_connect_directly(hosts, kept, ddeploy, monkeypatch):
    """A master that cannot import itself (a broken install): the command connects directly
    (OpenSSH's `ControlMaster auto`), with one note naming the master's log, which says why."""
    from deployer.transport import master_start

    monkeypatch.setattr(master_start, "MASTER_MODULE", "deployer.transport.no_such_master")
    res = ddeploy("status", "--host", "h1")
    assert res.code == 0, res.stderr
    [note] = [ln for ln in res.stderr.splitlines() if "connecting directly" in ln]
    log = Path(re.search(r"its log: (\S+)\)$", note).group(1))
    assert note.startswith("[h1] the connection master ended (exit status 1) before connecting")
    assert log.parent == kept and "No module named 'deployer.transport.no_such_master'" in log.read_text()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o700 and not _masters(kept)


# ---------------------------------------------------------------- the house
def transport_import_cycles(package: Path) -> list[str]:
    """The modules of `package` that reach themselves through its relative imports (lazy ones
    and those only for type checking included)."""
    import ast

    graph = {}
    for path in package.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = deps

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    return sorted(m for m in graph if m in reached(m))


def test_the_transport_modules_import_in_one_direction_and_stay_short():
    package = Path(control.__file__).parent
    assert transport_import_cycles(package) == []
    long = {p.name: n for p in package.glob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}
