"""ServerAliveInterval x ServerAliveCountMax on a real sshd (deployer/transport/keepalive.py): a host
whose sshd stops answering (SIGSTOP: the kernel still acknowledges TCP, as on a partitioned link
whose packets vanish) fails the running command within interval x count, with one line naming it;
a healthy idle link is left open."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from deployer.errors import ConnectError
from deployer.transport.connection import open_connection
from deployer.transport.ssh_connection import SSHConnection
from processes import free_port, wait_until
from sshd_hosts import SshdHost, _sshd_descendants
from test_ssh_config import make_host

pytestmark = pytest.mark.sshd


@pytest.fixture
def lone(hosts, tmp_path):
    """A host of this test's own (stopping it must not touch the shared fleet), and an ssh_config
    for it with ServerAliveInterval 1 and ServerAliveCountMax 2."""
    address = "127.0.0.24"
    (tmp_path / "lone").mkdir()
    h = SshdHost("lone", address, free_port(address), tmp_path / "lone", hosts.hosts[0].authorized_keys)
    h.start()
    known = tmp_path / "known_hosts"
    known.write_text(h.known_hosts_line())
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host lone\n  HostName {address}\n  Port {h.port}\n  User root\n  IdentityFile {hosts.client_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n  ServerAliveInterval 1\n  ServerAliveCountMax 2\n"
    )
    try:
        yield h, make_host("lone", config=str(config))
    finally:
        h.stop()


def _signal_sshd(h: SshdHost, sig: int) -> None:
    for pid in [h.proc.pid, *_sshd_descendants(h.proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("opened", ["direct", "kept"])
def test_a_host_that_stops_answering_fails_the_running_command_within_interval_x_count(lone, tmp_path, opened):
    """`kept`: through open_connection, a kept connection's master where kept connections are on."""
    h, host = lone
    pidfile = tmp_path / "sleep.pid"
    conn = SSHConnection(host) if opened == "direct" else open_connection(host)
    try:
        started = conn.start(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"])
        assert wait_until(lambda: pidfile.exists() and pidfile.read_text().strip())
        _signal_sshd(h, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ConnectError) as err:
            started.finish(timeout=25)  # without keepalives: blocked until this limit
        took = time.monotonic() - start
    finally:
        _signal_sshd(h, signal.SIGCONT)
        conn.close()
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    line = rf"\[t\] connection lost while running sh: no reply from root@{h.address}:{h.port} for 2 s "
    line += r"\(ServerAliveInterval 1 s x ServerAliveCountMax 2\); the link is down$"
    assert re.match(line, str(err.value)), err.value
    assert took < 1 * 2 + 10, took  # interval x count + the connect timeout, as slack


def test_a_healthy_idle_link_is_kept_open_by_answered_probes(lone):
    _, host = lone
    conn = SSHConnection(host)
    try:
        assert conn.run(["sleep", "4"]).ok  # 4 probes at 1 s, each answered; 2 unanswered would close it
        assert conn.run(["echo", "still"]).stdout == "still\n"
    finally:
        conn.close()
