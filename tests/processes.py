"""Helpers for tests that watch processes (and take ports) on the loopback test hosts."""

from __future__ import annotations

import socket
import stat
import sys
import time


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int:
    """The process's parent pid (OSError when it is gone)."""
    return int(_stat(pid)[1])


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def wait_until(cond, limit: float = 10.0) -> bool:
    """Poll `cond` until it holds or `limit` seconds pass; its last value."""
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def logging_python(tmp_path, h):
    """The host with a `python` that logs each start (its pid and the op: the agent's argv is
    `python -S -c BOOTSTRAP OP`), then runs the real one in the same process."""
    log = tmp_path / f"{h.name}-python.log"
    wrapper = tmp_path / f"{h.name}-python"
    wrapper.write_text(f'#!/bin/sh\necho "$$ $4" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return h.model_copy(update={"python": str(wrapper)}), log


def starts(log) -> list[str]:
    """The ops of the agents started so far."""
    return [line.split()[1] for line in log.read_text().splitlines()] if log.exists() else []


def running(log) -> list[int]:
    """The pids of the logged agents that are still running."""
    pids = [int(line.split()[0]) for line in log.read_text().splitlines()] if log.exists() else []
    return [pid for pid in pids if alive(pid)]
