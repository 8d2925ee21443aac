"""`ddeploy init`: a commented example host file to start an inventory from (like `kamal init`).

It is written as `_example.yaml`, which the inventory ignores (a leading `_`), so a placeholder
host never joins `--all`; copy it to `<name>.yaml` and edit it to add a host.
"""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

EXAMPLE_NAME = "_example.yaml"

EXAMPLE = """\
# An example ddeploy host (docs/inventory.md has every field). Files whose name starts with `_`
# are ignored: copy this one to gpu1.yaml (one file per host), edit it, then `ddeploy hosts`.
name: gpu1                      # used with --host; letters, digits, _ . - (max 63)

# How to reach it. Settings your ssh_config already has (User, Port, IdentityFile, ProxyJump)
# can stay out of here: `host` may be an alias from ~/.ssh/config or /etc/ssh/ssh_config.
ssh:
  host: gpu1.example.internal   # address or ssh_config alias
  user: ubuntu                  # optional
  # port: 22
  # identity: ~/.ssh/id_ed25519 # a private key file; ssh-agent keys are used as by ssh
  # jump: bastion               # ProxyJump: user@host:port or an alias, comma-separated hops

gpu:
  model: NVIDIA RTX PRO 6000 Blackwell Server Edition
  count: 8
  arch: sm_120                  # what the kernels are built for: sm_120 (RTX PRO 6000), sm_103 (B300)
interconnect: pcie              # pcie | nvlink

checkout: /opt/sglang           # the SGLang 0.5.23 git checkout on the host (absolute path)
python: /opt/sglang/.venv/bin/python   # the host's Python (>= 3.8 runs ddeploy's agent)
env:
  CUDA_HOME: /usr/local/cuda    # extra environment for commands on the host
groups: [prod]                  # for --group
"""


def write_example(directory: Path, *, force: bool = False) -> Path:
    """Write the example host file into `directory` (created if needed); refuses to overwrite."""
    path = directory / EXAMPLE_NAME
    if path.exists() and not force:
        raise UsageError(f"{path} exists; edit it, or pass --force to write it again")
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(EXAMPLE)
    return path
