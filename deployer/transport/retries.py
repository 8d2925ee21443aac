"""Connect retries: which failures are tried again, and how often (timeouts.py: the settings).

conn, attempts = with_retries(open_once, timeouts)   # a refused or timed-out connect is tried again
"""

from __future__ import annotations

import socket
import time
from typing import Callable, TypeVar

import paramiko
from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, NoValidConnectionsError

from .timeouts import MAX_RETRIES, Timeouts

__all__ = ["MAX_RETRIES", "Timeouts", "is_transient", "with_retries"]

T = TypeVar("T")
# paramiko.ChannelException codes (RFC 4254 5.1) a jump host answers when it will not open the
# next hop: ADMINISTRATIVELY_PROHIBITED (its sshd forbids it) and UNKNOWN_CHANNEL_TYPE never change.
NEVER_TRANSIENT_OPEN_FAILURES = (1, 3)


def is_transient(exc: BaseException) -> bool:
    """A connect that may work a moment later: refused (sshd not up yet, directly or through a
    jump host) or timed out. Never an authentication or host-key failure, nor a jump host that
    refuses to forward (administratively prohibited)."""
    if isinstance(exc, (AuthenticationException, BadHostKeyException)):
        return False
    if isinstance(exc, paramiko.ChannelException):  # a jump host could not open the next hop
        return exc.code not in NEVER_TRANSIENT_OPEN_FAILURES
    return isinstance(exc, (NoValidConnectionsError, ConnectionRefusedError, socket.timeout, TimeoutError))


def with_retries(connect: Callable[[], T], timeouts: Timeouts) -> tuple[T, int]:
    """connect(), tried again after a transient failure (is_transient) up to timeouts.retries
    times (at most MAX_RETRIES), waiting backoff, 2x backoff, ..., while the next attempt starts
    within timeouts.retry_window of the first; the result and the number of attempts. Raises the
    last failure with `attempts` set on it."""
    attempt, start = 0, time.monotonic()
    while True:
        attempt += 1
        try:
            return connect(), attempt
        except Exception as exc:
            wait = timeouts.backoff * 2 ** (attempt - 1)
            late = time.monotonic() + wait - start > timeouts.retry_window
            if attempt > min(timeouts.retries, MAX_RETRIES) or late or not is_transient(exc):
                exc.attempts = attempt  # type: ignore[attr-defined]
                raise
        time.sleep(wait)
