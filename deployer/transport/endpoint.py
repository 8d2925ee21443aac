"""What the SSH layer needs of an inventory host: its name, where its entry came from, its `ssh`
section and the environment its commands run with.

The inventory's Host (pydantic, loaded from YAML) is what a command validates; the SSH layer
(ssh.py, ssh_connection.py) reads only these fields of it. Keeping them in a plain dataclass lets
the connection master (control_master.py) rebuild a host from the client's JSON without importing
pydantic or the inventory models: its imports are on the first command's path, before it can
connect.

    endpoint = SSHEndpoint.of(host)                      # a command's (validated) Host
    SSHEndpoint.from_json(json.loads(json.dumps(endpoint.to_json())))  == endpoint
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..inventory import Host


@dataclass(frozen=True)
class SSHOptions:
    """A host's `ssh` section, as the inventory validated it (inventory.SSHSpec)."""

    host: str  # address or ssh_config alias
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    jump: str | None = None  # ProxyJump spec, user@bastion:22
    config: str | None = None  # ssh_config file, relative to `source`'s directory


@dataclass(frozen=True)
class SSHEndpoint:
    name: str
    source: str  # the host's YAML file, or "<builtin>"
    ssh: SSHOptions
    env: dict[str, str] = field(default_factory=dict)  # extra environment for its commands

    @classmethod
    def of(cls, host: Host | SSHEndpoint) -> SSHEndpoint:
        """The endpoint of an inventory host of connection `ssh` (an endpoint is its own)."""
        if isinstance(host, SSHEndpoint):
            return host
        if host.ssh is None:
            raise ValueError(f"host {host.name} has no ssh section")
        return cls(host.name, host.source, SSHOptions(**host.ssh.model_dump()), dict(host.env))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SSHEndpoint:
        return cls(str(data["name"]), str(data["source"]), SSHOptions(**data["ssh"]), dict(data.get("env") or {}))
