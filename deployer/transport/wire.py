"""The framing between a command and its connection master (control.py, control_master.py).

Frames: one kind byte, a 4-byte big-endian length, the payload.
  client -> master: HELLO (the master checks its connection), STOP (take no new command, close
  when the running ones end), START (JSON: argv, cwd, env, hold_stdin; then a DATA frame, the
  first input), FINISH (JSON: timeout, stream; then a DATA frame, the rest of the input).
  master -> client: OK (HELLO: the host's name; STOP: JSON host, running), LINE (one stderr line,
  while the command runs), RESULT (JSON: rc, stdout, stderr, signal), ERROR (JSON: kind,
  message; the kind a deployer.errors class).
"""

from __future__ import annotations

import json
import socket
from typing import BinaryIO

from .. import errors

WIRE = 2  # this framing's version; part of every socket's name
HELLO, STOP, START, FINISH, DATA = b"H", b"Q", b"S", b"F", b"D"
OK, LINE, RESULT, ERROR = b"K", b"L", b"R", b"E"


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(kind + len(payload).to_bytes(4, "big") + payload)


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """(kind, payload), or None at the end of the stream (a frame cut short ends it too)."""
    head = stream.read(5)
    if len(head) < 5:
        return None
    size = int.from_bytes(head[1:], "big")
    payload = stream.read(size)
    return (head[:1], payload) if len(payload) == size else None


def error_frame(exc: errors.DeployError) -> bytes:
    return json.dumps({"kind": type(exc).__name__, "message": exc.args[0] if exc.args else str(exc)}).encode()


def error_for(kind: str, message: str, host: str) -> errors.DeployError:
    """An error named by its deployer.errors class (by the master or the agent); unknown names
    become RemoteCommandError."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DeployError)):
        cls = errors.RemoteCommandError
    return cls(message, host=host)
