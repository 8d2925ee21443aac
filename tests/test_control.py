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
from deployer.transport.agent_client import agent_session
from deployer.transport.connection import open_connection
from deployer.transport.protocol import StatusReply
from processes import logging_python, parent, running, starts

pytestmark = pytest.mark.sshd
MASTER = "deployer.transport.control_master"


@pytest.fixture
def kept(hosts, monkeypatch):
    """Reuse on (60 s), in a socket directory of this test's own; every master gone afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="ddc-", dir="/tmp")) / "control"
    monkeypatch.setenv("DDEPLOY_CONTROL_PERSIST", "60")
    monkeypatch.setenv("DDEPLOY_CONTROL_DIR", str(directory))
    yield directory
    if directory.is_dir():
        directory.chmod(0o700)  # a test made it public
    control.disconnect()
    _wait(lambda: not _masters(directory), "the masters to exit")
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


# ---------------------------------------------------------------- standby commands
# A command that reads its input before doing anything (the agent: standby=True) is started ahead
# for the next command like it: the host's login shell and interpreter have started by then.
PROBE = "import os, sys; first = sys.stdin.readline(); print(os.getpid(), first.strip(), sys.stdin.read().strip())"


def _probes(code: str, *args: str) -> list[int]:
    """The pids of the host's python processes running `code` (not the sh that started them);
    with `args`, only those given exactly these arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[:3] == [sys.executable.encode(), b"-c", code.encode()]:
            if not args or argv[3:] == [a.encode() for a in args]:
                found.append(int(entry.name))
    return found


def _below_sshd(pid: int) -> list[int]:
    """pid and its ancestors up to (not including) the sshd process of its session."""
    chain = []
    while not Path(f"/proc/{pid}/comm").read_text().startswith("sshd"):
        chain.append(pid)
        pid = parent(pid)
    return chain


def _call(conn, argv, first: bytes, rest: bytes) -> tuple[int, list[str]]:
    out = conn.start(argv, first_input=first, standby=True).finish(rest).stdout.split()
    return int(out[0]), out[1:]


def test_the_next_standby_command_is_started_ahead_and_taken(hosts, kept, tmp_path):
    code = f"{PROBE}  # {tmp_path.name}"
    argv = [sys.executable, "-c", code]
    with open_connection(_host(hosts, "h1")) as conn:
        first, words = _call(conn, argv, b"a\n", b"b")
        assert words == ["a", "b"]
        _wait(lambda: len(_probes(code)) == 1, "a standby to start")
        [standby] = _probes(code)
        assert standby != first
        taken, words = _call(conn, argv, b"c\n", b"d")
        assert taken == standby and words == ["c", "d"]  # it ran the command, its input whole
        _wait(lambda: len(_probes(code)) == 1 and _probes(code) != [standby], "the next standby")
        [standby] = _probes(code)
        assert conn.run(argv, input=b"e\nf").stdout.split()[1:] == ["e", "f"]  # not a standby command
        assert _probes(code) == [standby]  # ... took none
        session = _below_sshd(standby)
        os.kill(standby, signal.SIGKILL)  # a standby gone since: the command starts as any other
        _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in session), "the killed standby to go")
        # sshd has reaped the standby's shell, so it sent that channel's exit status before it
        # confirms this command's channel: the master knows the standby has ended. (A standby
        # killed in the moment a command takes it fails that command, as the kill would.)
        conn.run(["true"])
        fresh, words = _call(conn, argv, b"g\n", b"h")
        assert fresh != standby and words == ["g", "h"]
        _wait(lambda: len(_probes(code)) == 1, "a standby to start again")
        other = [*argv, "other"]  # another command: started anew, then its own standby replaces it
        _call(conn, other, b"i\n", b"j")
        _wait(lambda: _probes(code) == _probes(code, "other") != [], "the other's standby to replace it")
    control.disconnect()
    _wait(lambda: not _masters(kept), "the master to exit")
    _wait(lambda: not _probes(code), "the other's standby to end with the connection")


def test_a_standby_gives_way_where_sshd_allows_one_session(hosts, kept, tmp_path):
    """MaxSessions 1: the standby holds the one session; a command that is not its kind still
    runs (the standby ends first)."""
    code = f"{PROBE}  # {tmp_path.name}"
    h2 = hosts.host("h2")
    h2.max_sessions = 1
    h2.stop()
    h2.start()
    try:
        with open_connection(_host(hosts, "h2")) as conn:
            _call(conn, [sys.executable, "-c", code], b"a\n", b"b")
            _wait(lambda: len(_probes(code)) == 1, "a standby to start")
            assert conn.run(["echo", "ran"]).stdout == "ran\n"
            assert not _probes(code)
    finally:
        control.disconnect()
        h2.max_sessions = 50
        h2.stop()
        h2.start()


def test_an_agent_call_over_a_kept_connection_runs_on_the_standby_agent(hosts, kept, tmp_path):
    """The agent reads its input before it acts, so the kept connection keeps the next agent
    started: the second call starts no agent of its own, and `disconnect` ends the one left."""
    h1, log = logging_python(tmp_path, _host(hosts, "h1"))
    with agent_session(h1) as agent:
        assert agent.call("status", {}, StatusReply).facts.head == hosts.base_commit
    _wait(lambda: len(starts(log)) == 2 and len(running(log)) == 1, "the standby agent")
    [standby] = running(log)
    with agent_session(h1) as agent:
        assert agent.call("status", {}, StatusReply).facts.head == hosts.base_commit
    _wait(lambda: len(starts(log)) == 3 and len(running(log)) == 1, "the next standby agent")
    assert starts(log) == ["status"] * 3 and running(log) != [standby]  # the standby ran the call
    control.disconnect()
    _wait(lambda: not running(log), "the standby agent to end with the connection")
    assert len(starts(log)) == 3
