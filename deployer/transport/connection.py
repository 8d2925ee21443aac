"""Connections to hosts: one interface for this machine (subprocess) and SSH hosts (Fabric).

    with open_connection(host) as conn:
        res = conn.run(["git", "-C", host.checkout, "rev-parse", "HEAD"])   # RunResult(rc, stdout, stderr)

Commands are argv lists, quoted with shlex before they reach the remote shell. Host keys are
checked strictly on every hop against known_hosts (deployer/transport/ssh.py);
`accept_new_host_keys=True` records an unknown key there, a changed key is always refused. A
refused or timed-out connect is tried again (with_retries); failures raise ConnectError with one
line naming the host.

The parts, one concern each (this module names them all, so callers import from here):
command.py (Connection, RunResult, StartedCommand), retries.py (Timeouts, with_retries),
local.py (LocalConnection), ssh_connection.py (SSHConnection, its channels), connect_errors.py,
direct.py (open_direct: a command's own connection), control.py (kept connections).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .command import Connection, RunResult, StartedCommand, Stream, killed_by, quote_argv, signal_rc
from .direct import open_direct
from .local import LocalConnection
from .timeouts import Timeouts

if TYPE_CHECKING:
    from ..inventory import Host

# Loaded when first used: a command that reuses a kept connection (control.py) never loads paramiko.
_LAZY = {
    "SSHConnection": "ssh_connection",
    "describe_connect_error": "connect_errors",
    "is_transient": "retries",
    "with_retries": "retries",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: F822 - four of them load on first use (__getattr__)
    "Connection",
    "LocalConnection",
    "RunResult",
    "SSHConnection",
    "StartedCommand",
    "Stream",
    "Timeouts",
    "describe_connect_error",
    "is_transient",
    "killed_by",
    "open_connection",
    "open_direct",
    "quote_argv",
    "signal_rc",
    "with_retries",
]

# paramiko's transport thread logs its own tracebacks (e.g. a banner timeout) through the root
# logger's last-resort handler; every failure already becomes one ConnectError line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def open_connection(host: Host, *, accept_new_host_keys: bool = False, timeouts: Timeouts | None = None) -> Connection:
    """Connect to a host (raises ConnectError); use as a context manager to close it. An SSH host
    is reached through its kept connection where reuse is on (control.py).

    Timeouts default to the DDEPLOY_*_TIMEOUT settings, so every command honours them."""
    from .control import Connector

    return Connector([host], accept_new_host_keys=accept_new_host_keys, timeouts=timeouts).open(host)
