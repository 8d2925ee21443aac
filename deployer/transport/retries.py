"""Connect timeouts and retries: how long a connect may take, and which failures are tried again.

timeouts = Timeouts.from_env()                       # DDEPLOY_*_TIMEOUT, DDEPLOY_CONNECT_RETRIES, ...
conn, attempts = with_retries(open_once, timeouts)   # a refused or timed-out connect is tried again
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import paramiko
from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, NoValidConnectionsError

from ..errors import ConnectError

T = TypeVar("T")
MAX_RETRIES = 10  # DDEPLOY_CONNECT_RETRIES above this is refused
# paramiko.ChannelException codes (RFC 4254 5.1) a jump host answers when it will not open the
# next hop: ADMINISTRATIVELY_PROHIBITED (its sshd forbids it) and UNKNOWN_CHANNEL_TYPE never change.
NEVER_TRANSIENT_OPEN_FAILURES = (1, 3)


@dataclass(frozen=True)
class Timeouts:
    connect: float | None = None  # TCP connect; None: the ssh_config's ConnectTimeout, else 10 s
    banner: float = 10.0  # SSH banner after TCP connect
    auth: float = 15.0
    command: float | None = None  # default per-command limit (None: no limit)
    keepalive: int = 15  # seconds between keepalives; a dead peer is noticed
    retries: int = 3  # connects tried again after a refusal or a timeout (a host rebooting)
    backoff: float = 1.0  # seconds before the first retry; doubled before each next one
    retry_window: float = 60.0  # no retry starts (its wait included) later than this after the first attempt

    @classmethod
    def from_env(cls) -> "Timeouts":
        """Defaults, overridden by DDEPLOY_{CONNECT,BANNER,AUTH,COMMAND}_TIMEOUT (seconds),
        DDEPLOY_CONNECT_RETRIES (a count) and DDEPLOY_CONNECT_BACKOFF (seconds)."""
        values: dict = _retry_settings()
        for name in ("connect", "banner", "auth", "command"):
            raw = os.environ.get(f"DDEPLOY_{name.upper()}_TIMEOUT")
            if raw:
                try:
                    values[name] = float(raw)
                except ValueError:
                    values[name] = float("nan")
                if not 0 < values[name] < 1e9:  # also refuses nan and inf
                    raise ConnectError(
                        f"DDEPLOY_{name.upper()}_TIMEOUT={raw!r} is not a number of seconds "
                        f"(must be positive and finite)"
                    )
        return cls(**values)


def _retry_settings() -> dict:
    values: dict = {}
    settings = (
        ("retries", "DDEPLOY_CONNECT_RETRIES", int, MAX_RETRIES),
        ("backoff", "DDEPLOY_CONNECT_BACKOFF", float, 60),
    )
    for name, key, kind, most in settings:
        raw = os.environ.get(key)
        if not raw:
            continue
        try:
            values[name] = kind(raw)
        except ValueError:
            values[name] = -1
        if not 0 <= values[name] <= most:
            raise ConnectError(f"{key}={raw!r} is not a {kind.__name__} between 0 and {most}")
    return values


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
