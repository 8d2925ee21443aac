"""OpenSSH parity on the real sshd test hosts: for each ssh_config, `ssh -F CONFIG -o BatchMode=yes
ALIAS true` and ddeploy's connection to ALIAS both connect or both refuse (host keys from every
known-hosts file, IdentitiesOnly with the agent's key, ConnectTimeout, a jump host that may not
forward)."""

from __future__ import annotations

import hashlib
import os
import pwd
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from paramiko.hostkeys import HostKeys

from deployer.errors import ConnectError
from deployer.transport.connection import open_connection
from processes import free_port
from sshd_hosts import SshdHost, _keygen
from test_ssh_config import make_host

pytestmark = pytest.mark.sshd
HOME = pwd.getpwuid(os.getuid()).pw_dir  # ssh's `~` and %d (the password database, not $HOME)


def ssh_says(config: Path, alias: str = "t") -> subprocess.CompletedProcess:
    cmd = ["ssh", "-F", str(config), "-o", "BatchMode=yes", alias, "true"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def ssh_connects(config: Path, alias: str = "t") -> bool:
    return ssh_says(config, alias).returncode == 0


def ddeploy_connects(config: Path, alias: str = "t", **kwargs) -> str:
    """The word ok, or ddeploy's one-line error."""
    try:
        with open_connection(make_host(alias, config=str(config)), **kwargs) as conn:
            return "ok" if conn.run(["true"]).ok else "failed"
    except ConnectError as exc:
        return str(exc)


def _config(path: Path, h, key: Path, extra: str) -> Path:
    path.write_text(
        f"Host t\n  HostName {h.address}\n  Port {h.port}\n  User root\n  IdentityFile {key}\n"
        f"  IdentitiesOnly yes\n  StrictHostKeyChecking yes\n{extra}"
    )
    return path


def _home_relative(path: Path) -> str:
    return os.path.relpath(path, HOME)


# ---------------------------------------------------------------- a. known-hosts files
@pytest.fixture
def stale_line(hosts, tmp_path):
    """h1's address and port with another host's key: a CHANGED key."""
    other = tmp_path / "other_host_key"
    _keygen(other, "other")
    h = hosts.hosts[0]
    return f"[{h.address}]:{h.port} " + " ".join(other.with_suffix(".pub").read_text().split()[:2]) + "\n"


def _cases(good: str, stale: str, h) -> list[tuple[str, dict[str, str], str]]:
    hashed = HostKeys.hash_host(f"[{h.address}]:{h.port}") + " " + good.split(" ", 1)[1]
    pattern = f"[{h.address.rsplit('.', 1)[0]}.*]:{h.port},!10.0.0.1 " + good.split(" ", 1)[1]
    return [
        ("in the second global file", {"g2": good}, "ok"),
        ("in the second user file", {"u2": good}, "ok"),
        ("in no file", {}, "is unknown"),
        ("changed in a global file", {"g1": stale}, "has CHANGED"),
        ("changed in one file, listed in another", {"g1": stale, "u1": good}, "ok"),
        ("changed and listed in one file", {"u2": stale + good}, "ok"),
        ("hashed", {"g1": hashed}, "ok"),
        ("a wildcard pattern", {"u1": pattern}, "ok"),
        ("revoked, and listed", {"g1": "@revoked " + good, "u1": good}, "REVOKED"),
    ]


def test_host_keys_from_every_known_hosts_file_as_ssh_reads_them(hosts, tmp_path, stale_line):
    h = hosts.hosts[0]
    files = {n: tmp_path / n for n in ("g1", "g2", "u1", "u2")}
    extra = f"  GlobalKnownHostsFile {files['g1']} {files['g2']}\n  UserKnownHostsFile {files['u1']} {files['u2']}\n"
    config = _config(tmp_path / "config", h, hosts.client_key, extra)
    for what, content, expected in _cases(h.known_hosts_line(), stale_line, h):
        for name, path in files.items():
            path.write_text(content.get(name, ""))
        said = ddeploy_connects(config)
        assert ssh_connects(config) == (expected == "ok"), f"ssh, key {what}"
        assert expected in said, f"ddeploy, key {what}: {said}"


def test_known_hosts_paths_take_tilde_tokens_and_environment_as_ssh_expands_them(hosts, tmp_path, monkeypatch):
    """UserKnownHostsFile: `~`, %d %u %h %p %% %n %r %k %i %C %L %l and ${VAR}; GlobalKnownHostsFile:
    `~` only (ssh leaves its %d alone). --accept-new-host-keys writes the first user file, and ssh
    then trusts what it wrote (hashed: HashKnownHosts yes)."""
    h = hosts.hosts[0]
    local = socket.gethostname()
    me = pwd.getpwuid(os.getuid()).pw_name
    c_hash = hashlib.sha1(f"{local}{h.address}{h.port}root".encode()).hexdigest()  # noqa: S324
    user = f"kh-{me}-{h.address}-{h.port}-%-t-root-t-{os.getuid()}-{c_hash}-{local.split('.')[0]}-{local}"
    monkeypatch.setenv("DDEPLOY_TEST_KH", str(tmp_path))
    pattern = "kh-%u-%h-%p-%%-%n-%r-%k-%i-%C-%L-%l"
    extra = (
        f"  UserKnownHostsFile ~/{_home_relative(tmp_path)}/{pattern} ${{DDEPLOY_TEST_KH}}/second\n"
        f"  GlobalKnownHostsFile ~/{_home_relative(tmp_path)}/global %d/{_home_relative(tmp_path)}/literal\n"
        "  HashKnownHosts yes\n"
    )
    config = _config(tmp_path / "config", h, hosts.client_key, extra)
    for name in (user, "second", "global"):
        (tmp_path / name).write_text(h.known_hosts_line())
        assert ssh_connects(config) and ddeploy_connects(config) == "ok", name
        (tmp_path / name).unlink()
    assert not ssh_connects(config) and "is unknown" in ddeploy_connects(config)
    (tmp_path / "literal").write_text(h.known_hosts_line())  # %d is not expanded in a global file
    assert not ssh_connects(config) and "is unknown" in ddeploy_connects(config)
    (tmp_path / user).write_text("")
    assert ddeploy_connects(config, accept_new_host_keys=True) == "ok"
    recorded = (tmp_path / user).read_text()
    assert recorded.startswith("|1|") and h.public_key[1] in recorded and not (tmp_path / "second").exists()
    assert ssh_connects(config) and ddeploy_connects(config) == "ok"


def test_an_unknown_token_is_refused_as_ssh_refuses_it(hosts, tmp_path):
    h = hosts.hosts[0]
    config = _config(tmp_path / "config", h, hosts.client_key, f"  UserKnownHostsFile {tmp_path}/kh-%Z\n")
    assert not ssh_connects(config)
    assert "unknown token %Z" in ddeploy_connects(config)


def test_the_default_known_hosts_files_are_ssh_defaults(tmp_path):
    from deployer.transport.ssh import connection_chain, ssh_config_for
    from deployer.transport.connection import Timeouts
    from deployer.transport.known_hosts import KnownHosts

    (tmp_path / "config").write_text("Host t\n  HostName 10.0.0.1\n")
    host = make_host("t", config=str(tmp_path / "config"))
    known = KnownHosts.for_hop(connection_chain(ssh_config_for(host, Timeouts()), host, Timeouts()))
    assert known.user_files == [Path(HOME, ".ssh/known_hosts"), Path(HOME, ".ssh/known_hosts2")]
    assert known.global_files == [Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2")]
    assert known.name == "10.0.0.1"


# ---------------------------------------------------------------- c. ConnectTimeout
@pytest.fixture
def blackhole():
    """(address, port) whose listen queue is full: a SYN there gets no answer (a dropped packet)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    address, fill = srv.getsockname(), []
    for _ in range(8):  # fill the queue until a connect is left hanging
        s = socket.socket()
        s.settimeout(0.2)
        fill.append(s)
        try:
            s.connect(address)
        except OSError:
            break
    try:
        yield address
    finally:
        for s in [*fill, srv]:
            s.close()


def _timed(fn) -> tuple[object, float]:
    """fn()'s result (or "still waiting" after 15 s) and how long it took, from a thread."""
    out: list = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(15)
    return (out[0] if out else "still waiting"), time.monotonic() - t0


def test_connect_timeout_in_the_ssh_config_is_kept_as_ssh_keeps_it(blackhole, tmp_path, monkeypatch):
    """`ConnectTimeout 1` bounds the host's connect for ssh and for ddeploy alike (not ddeploy's
    10 s default); `ConnectTimeout 0.5` is a bad configuration to both (ssh takes whole seconds)."""
    monkeypatch.setenv("DDEPLOY_CONNECT_RETRIES", "0")
    monkeypatch.delenv("DDEPLOY_CONNECT_TIMEOUT", raising=False)
    address, port = blackhole
    config = tmp_path / "config"
    config.write_text(f"Host t\n  HostName {address}\n  Port {port}\n  User root\n  ConnectTimeout 1\n")
    said, took = _timed(lambda: ssh_connects(config))
    assert said is False and took < 5, f"ssh took {took:.1f}s"
    said, took = _timed(lambda: ddeploy_connects(config))
    assert "timed out connecting" in str(said) and took < 5, f"ddeploy: {said} after {took:.1f}s"
    config.write_text(config.read_text().replace("ConnectTimeout 1", "ConnectTimeout 0.5"))
    assert not ssh_connects(config)
    assert "ConnectTimeout '0.5' is not a time" in ddeploy_connects(config)


def test_a_sub_second_connect_timeout_from_the_environment_is_kept(blackhole, tmp_path, monkeypatch):
    """DDEPLOY_CONNECT_TIMEOUT=0.5 is half a second, not 0 (which would be no timeout at all)."""
    monkeypatch.setenv("DDEPLOY_CONNECT_RETRIES", "0")
    monkeypatch.setenv("DDEPLOY_CONNECT_TIMEOUT", "0.5")
    address, port = blackhole
    config = tmp_path / "config"
    config.write_text(f"Host t\n  HostName {address}\n  Port {port}\n  User root\n  ConnectTimeout 30\n")
    said, took = _timed(lambda: ddeploy_connects(config))
    assert "timed out connecting" in str(said) and 0.4 < took < 3, f"ddeploy: {said} after {took:.1f}s"


# ---------------------------------------------------------------- d. a jump host that may not forward
class _NoForwarding(SshdHost):
    """A jump host whose sshd refuses every forward (`PermitOpen none`): administratively prohibited."""

    def _write_config(self) -> None:
        super()._write_config()
        with open(self.config_path, "a") as fh:
            fh.write("PermitOpen none\n")


@pytest.fixture
def closed_gate(hosts, tmp_path):
    address = "127.0.0.22"
    (tmp_path / "closed").mkdir()
    g = _NoForwarding("closed", address, free_port(address), tmp_path / "closed", hosts.hosts[0].authorized_keys)
    g.start()
    try:
        yield g
    finally:
        g.stop()


def test_a_jump_host_that_may_not_forward_is_refused_at_once_as_ssh_refuses(hosts, closed_gate, tmp_path, monkeypatch):
    monkeypatch.setenv("DDEPLOY_CONNECT_BACKOFF", "10")  # a retry would take 10 s
    h2, known = hosts.hosts[1], tmp_path / "known_hosts"
    known.write_text(closed_gate.known_hosts_line() + h2.known_hosts_line())
    kh = f"  UserKnownHostsFile {known}\n"
    config = _config(tmp_path / "config", h2, hosts.client_key, kh + "  ProxyJump gate\n")
    config.write_text(config.read_text() + _config(tmp_path / "g", closed_gate, hosts.client_key, kh).read_text()
                      .replace("Host t", "Host gate"))  # fmt: skip
    assert "administratively prohibited" in ssh_says(config).stderr
    said, took = _timed(lambda: ddeploy_connects(config))
    assert "refused to forward the connection (administratively prohibited" in str(said), said
    assert "tried" not in str(said) and took < 8


# ---------------------------------------------------------------- b. IdentitiesOnly and the agent
@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A real ssh-agent for this test (SSH_AUTH_SOCK set for ssh and ddeploy); add keys with ssh-add."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.05)
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    try:
        yield lambda key: subprocess.run(["ssh-add", "-q", str(key)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait()


def test_identities_only_keeps_the_agents_copy_of_the_named_key(hosts, tmp_path, agent):
    """An IdentityFile that exists only as .pub authenticates through the agent's copy, and only
    that key is offered: naming another agent-held key's .pub is refused by both."""
    import shutil

    h = hosts.hosts[0]
    foreign = tmp_path / "foreign"
    _keygen(foreign, "foreign")
    agent(hosts.client_key)
    agent(foreign)
    shutil.copy(hosts.client_key.with_suffix(".pub"), tmp_path / "held.pub")  # no private file beside it
    foreign.unlink()
    kh = f"  UserKnownHostsFile {hosts.known_hosts}\n"
    config = _config(tmp_path / "config", h, tmp_path / "held", kh)
    assert ssh_connects(config)
    assert ddeploy_connects(config) == "ok"
    config = _config(tmp_path / "config", h, foreign, kh)
    assert not ssh_connects(config)
    assert "authentication refused" in ddeploy_connects(config)
