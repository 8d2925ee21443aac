"""Connect timeouts and their settings: how long a connect may take and how often it is tried.

    timeouts = Timeouts.from_env()   # DDEPLOY_*_TIMEOUT, DDEPLOY_CONNECT_RETRIES, ...

Standard library only: a command that reuses a kept connection (control.py) reads its command
timeout here without loading paramiko.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConnectError

MAX_RETRIES = 10  # DDEPLOY_CONNECT_RETRIES above this is refused


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
