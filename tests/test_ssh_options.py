"""ssh_config options that paramiko 5 leaves to its user, checked against OpenSSH itself: `Include`
(deployer/transport/ssh_config_files.py) against `ssh -G`, and `StrictHostKeyChecking` against
`ssh` on a real sshd test host (ssh.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from deployer.errors import ConnectError
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
        config = _config(tmp_path / "config", h, hosts.client_key, f"  UserKnownHostsFile {known}\n")
        config.write_text(config.read_text().replace("StrictHostKeyChecking yes", f"StrictHostKeyChecking {value}"))
        assert ssh_connects(config) is connects, value
        known.write_text("")
        said = ddeploy_connects(config)
        assert (said == "ok") is connects, (value, said)
        assert (h.public_key[1] in known.read_text()) is connects, value
    known.write_text(f"[{h.address}]:{h.port} " + " ".join(hosts.hosts[1].public_key) + "\n")
    assert "has CHANGED" in ddeploy_connects(config)  # StrictHostKeyChecking no, a changed key
    config.write_text(config.read_text().replace("StrictHostKeyChecking no", "StrictHostKeyChecking maybe"))
    assert "StrictHostKeyChecking 'maybe' is not" in ddeploy_connects(config)
