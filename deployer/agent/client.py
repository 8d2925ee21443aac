"""Whether the client that asked for this operation is still there.

The client keeps the agent's stdin open for the whole call and sends nothing after the request,
so end of file on stdin means it has gone: Ctrl-C, a killed process, a cut SSH link (sshd closes
the command's stdin with the channel). Long operations (wait, bench, a launch that waits) look at
`gone()` between steps and stop the work they started rather than run on unseen; transactions
(push, rollback) finish regardless, so a cut link never leaves a checkout half-changed.
"""

import os
import threading

_GONE = threading.Event()


def watch(fd: int = 0) -> None:
    """Read file descriptor `fd` (stdin, after the request) to its end in a daemon thread; then the
    client has gone. The raw descriptor, not sys.stdin: a daemon thread blocked inside a buffered
    reader holds its lock, which the interpreter's shutdown would then wait for."""

    def drain() -> None:
        try:
            while os.read(fd, 65536):
                pass
        except (OSError, ValueError):
            pass
        _GONE.set()

    threading.Thread(target=drain, name="ddeploy-client-watch", daemon=True).start()


def gone() -> bool:
    return _GONE.is_set()


def pause(seconds: float) -> bool:
    """Sleep up to `seconds`; True when the client went away meanwhile (it ends the sleep)."""
    return _GONE.wait(seconds)
