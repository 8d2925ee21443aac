"""How a host's ssh_config becomes its Fabric connection (deployer/transport/ssh.py): which files
are read (the host's own alone, like `ssh -F`; else the user's, then the system's, as OpenSSH
reads them), what they set (User, Port, IdentityFile, ProxyJump, Match), ProxyJump chains in
OpenSSH's order, and strict host keys on every hop. The first tests only build the connection;
the rest connect to the real sshd test hosts."""

from __future__ import annotations

import getpass
import subprocess
import sys
from pathlib import Path

import pytest

from deployer.errors import ConnectError
from deployer.inventory import Host
from deployer.transport.connection import Timeouts, open_connection
from deployer.transport.ssh import connection_chain, hops, split_spec, ssh_config_for
from deployer.transport.ssh_connection import SSHConnection
from processes import free_port
from sshd_hosts import SshdHost

CONFIG = """Host b300
  HostName 10.0.0.1
  User bob
  Port 2222
  IdentityFile /keys/b300
  ProxyJump j1,carol@j2:2200
Host j1
  HostName 10.0.0.9
  ConnectTimeout 3
Host legacy
  ProxyCommand nc %h %p
"""


def make_host(alias: str, *, source: str = "<test>", **ssh) -> Host:
    return Host.model_validate(
        {
            "name": "t",
            "ssh": {"host": alias, **ssh},
            "gpu": {"model": "NVIDIA B300 SXM6", "count": 8, "arch": "sm_103"},
            "interconnect": "nvlink",
            "checkout": "/opt/sglang",
            "source": source,
        }
    )


def chain(host: Host):
    return connection_chain(ssh_config_for(host, Timeouts()), host, Timeouts())


def test_settings_come_from_the_file_and_explicit_ones_win(tmp_path):
    (tmp_path / "ssh_config").write_text(CONFIG)
    conn = chain(make_host("b300", config=str(tmp_path / "ssh_config")))
    assert (conn.user, conn.host, conn.port) == ("bob", "10.0.0.1", 2222)
    assert conn.connect_kwargs["key_filename"] == ["/keys/b300"]
    key = tmp_path / "k"
    key.write_text("")
    explicit = make_host(
        "b300", config=str(tmp_path / "ssh_config"), user="root", port=22, identity=str(key), jump="none"
    )
    conn = chain(explicit)
    assert (conn.user, conn.port, conn.gateway) == ("root", 22, False)
    assert conn.connect_kwargs["key_filename"] == [str(key), "/keys/b300"]  # the inventory's first
    assert chain(make_host("legacy", config=str(tmp_path / "ssh_config"))).gateway == "nc legacy 22"


def test_proxyjump_hops_are_connected_in_openssh_order(tmp_path):
    (tmp_path / "ssh_config").write_text(CONFIG)
    conn = chain(make_host("b300", config=str(tmp_path / "ssh_config")))
    me = getpass.getuser()
    got = [(f"{c.user}@{c.host}:{c.port}", c.connect_kwargs["timeout"]) for c in hops(conn)]
    assert got == [(f"{me}@10.0.0.9:22", 3), ("carol@j2:2200", 10), ("bob@10.0.0.1:2222", 10)]  # j1 first


@pytest.mark.parametrize(
    "spec, parts",
    [
        ("h", (None, "h", None)),
        ("u@h:22", ("u", "h", 22)),
        ("[::1]:2200", (None, "::1", 2200)),
        ("ssh://u@h:2200", ("u", "h", 2200)),
        ("ssh://[::1]:22", (None, "::1", 22)),
    ],
)
def test_proxyjump_specs(spec, parts):
    assert split_spec(spec) == parts


def test_the_users_file_then_the_systems_as_openssh_reads_them(tmp_path, monkeypatch):
    """Without a file named for the host, both are read; a setting's first value wins, and the
    user's file comes first."""
    (tmp_path / "user").write_text("Host b300\n  Port 2200\nMatch originalhost b300\n  User matched\n")
    (tmp_path / "system").write_text("Host *\n  Port 1\n  User nobody\n  HostName 10.0.0.7\n")
    monkeypatch.setenv("DDEPLOY_USER_SSH_CONFIG", str(tmp_path / "user"))
    monkeypatch.setenv("DDEPLOY_SYSTEM_SSH_CONFIG", str(tmp_path / "system"))
    monkeypatch.delenv("DDEPLOY_SSH_CONFIG", raising=False)
    conn = chain(make_host("b300"))
    assert (conn.user, conn.host, conn.port) == ("matched", "10.0.0.7", 2200)
    (tmp_path / "own").write_text("Host b300\n  HostName 10.1.1.1\n")  # a host's own file replaces both
    conn = chain(make_host("b300", config=str(tmp_path / "own")))
    assert (conn.host, conn.port) == ("10.1.1.1", 22)


def test_match_exec_is_evaluated(tmp_path):
    """`Match exec` runs its command (paramiko does that through invoke), as OpenSSH does; in a
    process of its own, because invoke reads the stdin that pytest captures."""
    (tmp_path / "exec").write_text('Match exec "test -n x"\n  User matched\n' + CONFIG)
    probe = (
        "import sys; from test_ssh_config import chain, make_host; "
        "print(chain(make_host('legacy', config=sys.argv[1])).user)"
    )
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); {probe}", str(tmp_path / "exec")],
        capture_output=True,
        text=True,
    )
    assert proc.stdout.split() == ["matched"], proc.stderr


# ---------------------------------------------------------------- real sshd hosts
class _Gate(SshdHost):
    """A jump host that forwards only to one address (sshd's PermitOpen): a chain through it works
    only when it is the first hop, before the host it may reach."""

    permit: str = ""

    def _write_config(self) -> None:
        super()._write_config()
        with open(self.config_path, "a") as fh:
            fh.write(f"PermitOpen {self.permit}\n")


@pytest.fixture
def gate(hosts, tmp_path):
    address = "127.0.0.21"
    h2 = hosts.hosts[1]
    (tmp_path / "gate").mkdir()
    g = _Gate("gate", address, free_port(address), tmp_path / "gate", hosts.hosts[0].authorized_keys)
    g.permit = f"{h2.address}:{h2.port}"
    g.start()
    try:
        yield g
    finally:
        g.stop()


def _block(alias: str, h, known_hosts: Path, key: Path, extra: str = "") -> str:
    return (
        f"Host {alias}\n  HostName {h.address}\n  Port {h.port}\n  User root\n  IdentityFile {key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n{extra}"
    )


def test_two_jump_hosts_in_openssh_order_with_strict_host_keys_on_every_hop(hosts, gate, tmp_path, monkeypatch):
    h2, h3 = hosts.hosts[1], hosts.hosts[2]
    known = tmp_path / "known_hosts"
    lines = {"gate": gate.known_hosts_line(), "j2": h2.known_hosts_line(), "tgt": h3.known_hosts_line()}
    key = hosts.client_key
    config = tmp_path / "user_config"
    config.write_text(
        _block("gate", gate, known, key)
        + _block("j2", h2, known, key)
        # the target's settings from a Match block, as OpenSSH applies them
        + f"Host tgt\n  HostName {h3.address}\n  ProxyJump gate,j2\n"
        + f"Match host {h3.address}\n  Port {h3.port}\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
        + f"  UserKnownHostsFile {known}\n"
    )
    monkeypatch.setenv("DDEPLOY_USER_SSH_CONFIG", str(config))
    monkeypatch.setenv("DDEPLOY_SYSTEM_SSH_CONFIG", str(tmp_path / "none"))
    host = make_host("tgt", source=str(tmp_path / "inv" / "t.yaml"))
    known.write_text("".join(lines.values()))
    with open_connection(host) as conn:  # gate can forward only to j2: a reversed chain would fail
        assert conn.run(["sh", "-c", "echo $DDEPLOY_TEST_HOST"]).stdout.strip() == "h3"
    for hop, address in (("gate", gate.address), ("j2", h2.address), ("tgt", h3.address)):
        known.write_text("".join(line for name, line in lines.items() if name != hop))
        with pytest.raises(ConnectError, match=rf"\[t\] host key for root@{address}:\d+.* is unknown"):
            open_connection(host)
        forged = {**lines, hop: lines[hop].split()[0] + " " + hosts.hosts[0].known_hosts_line().split(" ", 1)[1]}
        known.write_text("".join(forged.values()))
        with pytest.raises(ConnectError, match=rf"\[t\] host key for root@{address}:\d+.* has CHANGED"):
            open_connection(host, accept_new_host_keys=True)
    known.write_text("".join(line for name, line in lines.items() if name != "j2"))
    with open_connection(host, accept_new_host_keys=True) as conn:  # the opt-in records a middle hop's key
        assert conn.run(["true"]).ok
    assert h2.known_hosts_line().split()[2] in known.read_text()


def test_server_alive_settings_come_from_the_file_with_ddeploys_default(tmp_path):
    """ServerAliveInterval/CountMax as written (a time; 0: off); none written: 15 s x OpenSSH's 3;
    a value that is not a number is refused before connecting, naming the file."""
    config = tmp_path / "ssh_config"
    config.write_text("Host fast\n  ServerAliveInterval 1m\n  ServerAliveCountMax 5\n")
    config.write_text(config.read_text() + "Host off\n  ServerAliveInterval 0\n")
    assert chain(make_host("fast", config=str(config))).server_alive == (60, 5)
    assert chain(make_host("off", config=str(config))).server_alive[0] == 0
    assert chain(make_host("plain", config=str(config))).server_alive == (15, 3)
    config.write_text("Host bad\n  ServerAliveCountMax many\n")
    with pytest.raises(ConnectError, match=rf"ssh_config {config} cannot be used for bad: .*ServerAliveCountMax"):
        SSHConnection(make_host("bad", config=str(config)))
