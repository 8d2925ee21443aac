"""One line for a failed connect: what happened, on which hop, and what to do next."""

from __future__ import annotations

import socket

from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, ChannelException
from paramiko.ssh_exception import NoValidConnectionsError, SSHException


def attempts_note(exc: BaseException) -> str:
    """` (tried N times)` after a connect that was tried again (with_retries), else nothing."""
    n = getattr(exc, "attempts", 1)
    return f" (tried {n} times)" if n > 1 else ""


def describe_connect_error(exc: BaseException, target: str) -> str:
    """One line for a failed connect: what happened and what to do next."""
    msg = str(exc)
    if isinstance(exc, BadHostKeyException):
        return (
            f"host key for {target} has CHANGED (possible man-in-the-middle); refusing to connect. "
            f"If the host was reinstalled, verify the new key and remove the old one from known_hosts"
        )
    if isinstance(exc, SSHException) and "not found in known_hosts" in msg:
        return (
            f"host key for {target} is unknown (not in known_hosts); verify it and rerun with "
            f"--accept-new-host-keys to record it"
        )
    if isinstance(exc, SSHException) and "is REVOKED" in msg:
        return f"host key for {target} is REVOKED in known_hosts (@revoked); refusing to connect"
    if isinstance(exc, AuthenticationException):
        return f"authentication refused by {target} ({msg or 'no accepted key'}); check user and identity file"
    if isinstance(exc, ChannelException) and exc.code == 1:
        return (
            f"{target}: the jump host refused to forward the connection (administratively prohibited: its "
            f"sshd's AllowTcpForwarding/PermitOpen forbid it); allow it there or use another ProxyJump"
        )
    if isinstance(exc, ChannelException):
        return f"{target}: the jump host could not open the connection ({exc.text}); is sshd running there?"
    if isinstance(exc, NoValidConnectionsError):
        return f"{target} is unreachable (connection refused); is sshd running and the address right?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {target} ({exc.strerror}); check the address in the inventory or ssh_config"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out connecting to {target}; check the network/firewall"
    if isinstance(exc, SSHException) and ("banner" in msg.lower() or "No existing session" in msg):
        return f"{target} accepted TCP but sent no SSH banner (banner timeout); is it an SSH server?"
    if isinstance(exc, FileNotFoundError) and exc.filename:  # paramiko's last word after every key failed
        return f"authentication refused by {target} (no key accepted; identity file {exc.filename} does not exist)"
    if isinstance(exc, OSError):
        return f"cannot connect to {target}: {exc.strerror or exc}"
    return f"cannot connect to {target}: {type(exc).__name__}: {msg.splitlines()[0] if msg else ''}"
