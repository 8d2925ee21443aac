"""This machine as a host (the built-in `local`): commands run as subprocesses, argv, no shell."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from ..errors import RemoteCommandError
from .command import Connection, LineSplitter, RunResult, Stream, check_result, signal_rc
from .timeouts import Timeouts

if TYPE_CHECKING:
    from ..inventory import Host


class LocalConnection(Connection):
    """This machine: commands run as subprocesses (argv, no shell)."""

    def __init__(self, host: Host, timeouts: Timeouts | None = None):
        self.host, self.timeouts = host, timeouts or Timeouts()

    def run(self, argv, *, cwd=None, env=None, check=True, timeout=None, stream=None, input=None, hold_stdin=False):
        full_env = {**os.environ, **self.host.env, **(env or {})}
        timeout = timeout if timeout is not None else self.timeouts.command
        try:
            proc = subprocess.Popen(
                [str(a) for a in argv],
                cwd=cwd,
                env=full_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            return check_result(self.name, argv, RunResult(127, "", f"{argv[0]}: {exc.strerror}"), check)
        try:
            out, err = _pump_local(proc, input, stream, timeout, self.name, hold_stdin)
        finally:  # the command sees end of file now (when held: the client is done or gone)
            _close_quietly(proc.stdin)
        if proc.returncode < 0:  # killed by a signal, as an SSH host reports it
            name = signal.Signals(-proc.returncode).name
            return check_result(self.name, argv, RunResult(signal_rc(name), out, err, signal=name[3:]), check)
        return check_result(self.name, argv, RunResult(proc.returncode, out, err), check)


def _pump_local(
    proc: subprocess.Popen,
    input: bytes | None,
    stream: Stream | None,
    timeout: float | None,
    host: str,
    hold_stdin: bool = False,
) -> tuple[str, str]:
    """Collect stdout, stream stderr line by line (progress), feed stdin (closed after the input
    unless held); enforce the timeout."""
    if input:
        threading.Thread(target=_feed_stdin, args=(proc.stdin, input, not hold_stdin), daemon=True).start()
    elif not hold_stdin:
        proc.stdin.close()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    splitter = LineSplitter(stream)
    deadline = time.monotonic() + timeout if timeout else None
    open_fds = set(bufs)
    while open_fds:
        wait = max(0.0, deadline - time.monotonic()) if deadline else None
        ready, _, _ = select.select(list(open_fds), [], [], wait)
        if not ready:
            proc.kill()
            proc.wait()
            raise RemoteCommandError(f"command timed out after {timeout:g}s", host=host)
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
                continue
            bufs[fd] += data
            if fd == proc.stderr.fileno():
                splitter.feed(data)
    splitter.flush()
    proc.wait()
    out, err = bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()]
    proc.stdout.close()
    proc.stderr.close()
    return out.decode(errors="replace"), err.decode(errors="replace")


def _feed_stdin(pipe, data: bytes, close: bool = True) -> None:
    try:
        pipe.write(data)
        pipe.flush()
        if close:
            pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _close_quietly(pipe) -> None:
    try:
        pipe.close()
    except (BrokenPipeError, OSError):
        pass
