"""ssh_config options that paramiko 5 leaves to its user, checked against OpenSSH itself: `Include`
(deployer/transport/ssh_config_files.py) against `ssh -G`, and `StrictHostKeyChecking` against
`ssh` on a real sshd test host (ssh.py), and `IdentitiesOnly` with a passphrase-protected key
held by a real ssh-agent (agent_keys.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from deployer.errors import ConnectError
from processes import free_port, wait_until
from sshd_hosts import SshdHost
from test_ssh_config import chain, make_host
from test_ssh_parity import HOME, _config, ddeploy_connects, ssh_connects


def ssh_g(config, alias: str) -> tuple[str, int, str]:
    """(hostname, port, user) as `ssh -G` resolves them."""
    out = subprocess.run(["ssh", "-G", "-F", str(config), alias], capture_output=True, text=True, check=True).stdout
    got = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    return got["hostname"], int(got["port"]), got["user"]


def ours(config, alias: str) -> tuple[str, int, str]:
    conn = chain(make_host(alias, config=str(config)))
    return conn.host, conn.port, conn.user


def test_include_is_read_as_ssh_reads_it(tmp_path):
    """At the top and inside a Host block (only there), a glob under ~ in lexical order (the first
    value wins), a name that matches nothing, and the block restated after it."""
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "top.conf").write_text("Host early\n  HostName 10.0.0.5\n")
    (tmp_path / "conf.d" / "10-a.conf").write_text(
        "User alice\nHost b300 other\n  HostName 10.9.9.9\nHost other\n  HostName 10.8.8.8\n"
    )
    (tmp_path / "conf.d" / "20-b.conf").write_text("User bob\nPort 2200\n")
    home_relative = "~/" + os.path.relpath(tmp_path / "conf.d", HOME)  # ssh's ~ is pw_dir
    main = tmp_path / "main"
    main.write_text(
        f"Include {tmp_path / 'top.conf'}\nHost b300\n  Include {home_relative}/*.conf nothing-here-*.conf\n"
        "  Port 2222\nHost *\n  User fallback\n"
    )
    for alias in ("b300", "early", "other", "plain"):
        assert ours(main, alias) == ssh_g(main, alias), alias
    assert ours(main, "b300") == ("10.9.9.9", 2200, "alice")


def test_a_relative_include_is_under_etc_ssh_in_the_system_file(tmp_path, monkeypatch):
    """(Under ~/.ssh in a user file: ssh -G agrees only where ~/.ssh exists, so not asserted here.)"""
    (tmp_path / "sys.d").mkdir()
    (tmp_path / "sys.d" / "a.conf").write_text("Host b300\n  HostName 10.7.7.7\n")
    (tmp_path / "system").write_text(f"Include {os.path.relpath(tmp_path / 'sys.d', '/etc/ssh')}/a.conf\n")
    monkeypatch.setenv("DDEPLOY_SYSTEM_SSH_CONFIG", str(tmp_path / "system"))
    monkeypatch.setenv("DDEPLOY_USER_SSH_CONFIG", str(tmp_path / "no-user-file"))
    monkeypatch.delenv("DDEPLOY_SSH_CONFIG", raising=False)
    assert chain(make_host("b300")).host == "10.7.7.7"


def test_an_include_loop_is_refused_naming_the_file_and_line(tmp_path):
    loop = tmp_path / "loop"
    loop.write_text(f"User x\nInclude {loop}\n")
    assert subprocess.run(["ssh", "-G", "-F", str(loop), "h"], capture_output=True).returncode != 0
    with pytest.raises(ConnectError, match=rf"^\[t\] ssh_config {loop} cannot .*{loop} line 2: Include nested more"):
        chain(make_host("h", config=str(loop)))


@pytest.mark.sshd
def test_strict_host_key_checking_accept_new_and_no_record_unknown_keys_and_refuse_changed_ones(hosts, tmp_path):
    """accept-new connects to an unknown host and records its key, as ssh does; `no` is read as
    accept-new (ssh would also connect to a CHANGED key; ddeploy never does); yes refuses."""
    h = hosts.hosts[0]
    known = tmp_path / "known_hosts"
    for value, connects in (("yes", False), ("accept-new", True), ("no", True)):
        known.write_text("")
        config = _config(tmp_path / value, h, hosts.client_key, f"  UserKnownHostsFile {known}\n")
        config.write_text(config.read_text().replace("StrictHostKeyChecking yes", f"StrictHostKeyChecking {value}"))
        assert ssh_connects(config) is connects, value
        known.write_text("")
        said = ddeploy_connects(config)
        assert (said == "ok") is connects, (value, said)
        assert (h.public_key[1] in known.read_text()) is connects, value
    known.write_text(f"[{h.address}]:{h.port} " + " ".join(hosts.hosts[1].public_key) + "\n")
    assert "has CHANGED" in ddeploy_connects(_fresh(config, "no-changed"))  # StrictHostKeyChecking no
    config = _fresh(config, "maybe")
    config.write_text(config.read_text().replace("StrictHostKeyChecking no", "StrictHostKeyChecking maybe"))
    assert "StrictHostKeyChecking 'maybe' is not" in ddeploy_connects(config)


@pytest.fixture
def locked_key_host(hosts, tmp_path, monkeypatch):
    """A passphrase-protected key, loaded in a real ssh-agent of this test (SSH_AUTH_SOCK set), and
    a host of its own whose authorized_keys holds only that key."""
    key = tmp_path / "locked"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret phrase", "-C", "locked", "-f", str(key)]
    subprocess.run(keygen, check=True, capture_output=True)
    askpass = tmp_path / "askpass"
    askpass.write_text("#!/bin/sh\necho 'secret phrase'\n")
    askpass.chmod(0o700)
    (tmp_path / "host").mkdir()
    (tmp_path / "authorized_keys").write_text(key.with_name("locked.pub").read_text())
    h = SshdHost("locked", "127.0.0.25", free_port("127.0.0.25"), tmp_path / "host", tmp_path / "authorized_keys")
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        assert wait_until(sock.exists)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        env = {**os.environ, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}
        subprocess.run(["ssh-add", "-q", str(key)], env=env, stdin=subprocess.DEVNULL, check=True, capture_output=True)
        h.start()
        (tmp_path / "known_hosts").write_text(h.known_hosts_line())
        yield h, key, _config(tmp_path / "config", h, key, f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n")
    finally:
        h.stop()
        agent.terminate()
        agent.wait()


@pytest.mark.sshd
def test_identities_only_offers_a_passphrase_protected_key_through_the_agent_that_holds_it(locked_key_host):
    """The named IdentityFile is the encrypted private key; the agent's copy is offered (matched by
    its .pub, then, with no .pub, by the private file's own public key), never a prompt."""
    h, key, config = locked_key_host
    assert ssh_connects(config)
    assert ddeploy_connects(config) == "ok"
    key.with_name("locked.pub").unlink()
    config = _fresh(config, "no-pub")  # each check authenticates afresh, not on a kept connection
    assert ssh_connects(config)
    assert ddeploy_connects(config) == "ok"
    subprocess.run(["ssh-add", "-D"], check=True, capture_output=True)  # the agent forgets it
    config = _fresh(config, "forgotten")
    assert not ssh_connects(config)
    assert "authentication refused" in ddeploy_connects(config)


def _fresh(config, name: str):
    """A copy of the ssh_config under another name: ddeploy keeps no connection for it yet."""
    copy = config.with_name(name)
    copy.write_text(config.read_text())
    return copy
