"""How a host's ssh_config becomes connection settings (deployer/transport/ssh_config.py), read
from real files; the connections themselves are tested against real sshd in test_connection.py."""

from __future__ import annotations

import getpass
import subprocess
import sys
import pytest

from deployer.transport.ssh_config import load_ssh_config, resolve_hop, split_spec

CONFIG = """Host b300
  HostName 10.0.0.1
  User bob
  Port 2222
  IdentityFile ~/.ssh/b300
  ProxyJump j1,carol@j2:2200
Host j1
  HostName 10.0.0.9
  ConnectTimeout 3
Host legacy
  ProxyCommand nc %h %p
"""


def test_settings_come_from_the_file_and_explicit_ones_win(tmp_path):
    (tmp_path / "ssh_config").write_text(CONFIG)
    config = load_ssh_config(tmp_path / "ssh_config")
    hop = resolve_hop(config, "b300")
    assert (hop.target, hop.key_filenames[0].endswith("/.ssh/b300")) == ("bob@10.0.0.1:2222", True)
    explicit = resolve_hop(config, "b300", user="root", port=22, identity="/k", jump="none")
    assert (explicit.target, explicit.key_filenames[0], explicit.gateway) == ("root@10.0.0.1:22", "/k", None)
    assert resolve_hop(config, "legacy").proxy_command == "nc legacy 22"


def test_proxyjump_hops_are_connected_in_openssh_order(tmp_path):
    (tmp_path / "ssh_config").write_text(CONFIG)
    hop = resolve_hop(load_ssh_config(tmp_path / "ssh_config"), "b300")
    chain = []
    while hop is not None:
        chain.append((hop.target, hop.connect_timeout))
        hop = hop.gateway
    me = getpass.getuser()
    assert chain == [("bob@10.0.0.1:2222", None), ("carol@j2:2200", None), (f"{me}@10.0.0.9:22", 3)]  # j1 first


@pytest.mark.parametrize(
    "spec, parts", [("h", (None, "h", None)), ("u@h:22", ("u", "h", 22)), ("[::1]:2200", (None, "::1", 2200))]
)
def test_proxyjump_specs(spec, parts):
    assert split_spec(spec) == parts


def test_match_exec_is_evaluated(tmp_path):
    """`Match exec` runs its command (paramiko does that through invoke), as OpenSSH does; in a
    process of its own, because invoke reads the stdin that pytest captures."""
    (tmp_path / "exec").write_text('Match exec "test -n x"\n  User matched\n' + CONFIG)
    probe = (
        "import sys; from pathlib import Path; from deployer.transport.ssh_config import load_ssh_config, resolve_hop;"
        "print(resolve_hop(load_ssh_config(Path(sys.argv[1])), 'legacy').user)"
    )
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "exec")], capture_output=True, text=True)
    assert proc.stdout.split() == ["matched"], proc.stderr
