"""Helpers for tests that watch processes on the (loopback) test hosts."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond, limit: float = 10.0) -> bool:
    """Poll `cond` until it holds or `limit` seconds pass; its last value."""
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()
