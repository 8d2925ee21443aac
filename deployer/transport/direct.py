"""A command's own connection to a host, closed with it: a subprocess for this machine, an
SSHConnection (paramiko, loaded only here) for an SSH host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .command import Connection
from .local import LocalConnection
from .timeouts import Timeouts

if TYPE_CHECKING:
    from ..inventory import Host


def open_direct(host: Host, *, accept_new_host_keys: bool = False, timeouts: Timeouts | None = None) -> Connection:
    """This command's own connection to the host, closed with it."""
    timeouts = timeouts or Timeouts.from_env()
    if host.is_local:
        return LocalConnection(host, timeouts)
    from .ssh_connection import SSHConnection

    return SSHConnection(host, accept_new_host_keys=accept_new_host_keys, timeouts=timeouts)
