"""A host reached through its kept connection (control.py): each command one socket connection
to the connection master, which runs it on a channel of its SSH transport (wire.py: the frames).
No paramiko here: the command's own process pays no handshake and no key lookup."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import ConnectError, RemoteCommandError
from .command import Connection, RunResult, StartedCommand, Stream, check_result
from .timeouts import Timeouts
from .wire import DATA, ERROR, FINISH, LINE, RESULT, START, error_for, read_frame, send_frame

if TYPE_CHECKING:
    from ..inventory import Host


def dial(path: Path) -> socket.socket | None:
    """A socket connection to the master at `path`, or None when no master listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError:
        sock.close()
        raise
    return sock


class SharedConnection(Connection):
    """A host reached through its kept connection: one socket connection per command. A command
    that finds the connection closed since (idle, stopped, the link dropped) connects anew: a new
    master, or this command's own connection where none starts."""

    def __init__(self, host: Host, path: Path, timeouts: Timeouts, reopen: Callable[[], Connection]):
        self.host, self.path, self.timeouts = host, path, timeouts
        self._reopen = reopen  # the host's connection anew (control.Connector.open)
        self._lock = threading.Lock()
        self._running: set[socket.socket] = set()  # the sockets of commands not finished yet
        self._fallback: Connection | None = None  # the command's own connection, once needed

    def close(self) -> None:
        """Cut the commands still running, as closing a connection of the command's own would:
        their channels close and a `finish` waiting on one raises ConnectError. The kept
        connection stays open for the next command."""
        with self._lock:
            running, self._running = list(self._running), set()
            fallback, self._fallback = self._fallback, None
        for sock in running:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if fallback is not None:
            fallback.close()

    def _track(self, sock: socket.socket, running: bool) -> None:
        with self._lock:
            (self._running.add if running else self._running.discard)(sock)

    def _reconnect(self) -> socket.socket | Connection:
        """The kept connection closed since: a new one's socket, or this command's own connection."""
        conn = self._reopen()
        if isinstance(conn, SharedConnection):
            sock = dial(conn.path)
            if sock is not None:
                return sock
            raise OSError("no connection master listens")
        with self._lock:
            self._fallback = conn
        return conn

    def start(self, argv, *, cwd=None, env=None, first_input=b"", hold_stdin=False) -> StartedCommand:
        if self._fallback is not None:
            return self._fallback.start(argv, cwd=cwd, env=env, first_input=first_input, hold_stdin=hold_stdin)
        sock = None
        try:
            sock = dial(self.path) or self._reconnect()
            if isinstance(sock, Connection):
                return sock.start(argv, cwd=cwd, env=env, first_input=first_input, hold_stdin=hold_stdin)
            command = {"argv": [str(a) for a in argv], "cwd": cwd, "env": env, "hold_stdin": hold_stdin}
            self._track(sock, True)
            send_frame(sock, START, json.dumps(command).encode())
            send_frame(sock, DATA, first_input)
        except OSError as exc:
            if isinstance(sock, socket.socket):
                self._track(sock, False)
                sock.close()
            raise ConnectError(f"lost the kept connection while starting {argv[0]}: {exc}", host=self.name) from None
        return _SharedCommand(self, list(argv), sock)

    def run(self, argv, *, cwd=None, env=None, check=True, timeout=None, stream=None, input=None, hold_stdin=False):
        started = self.start(argv, cwd=cwd, env=env, hold_stdin=hold_stdin)
        return started.finish(input, check=check, timeout=timeout, stream=stream)


class _SharedCommand(StartedCommand):
    def __init__(self, conn: SharedConnection, argv: list[str], sock: socket.socket):
        self.conn, self.argv, self.sock = conn, argv, sock

    def finish(self, input=None, *, check=True, timeout=None, stream: Stream | None = None) -> RunResult:
        timeout = timeout if timeout is not None else self.conn.timeouts.command
        name = self.conn.name
        try:
            with self.sock, self.sock.makefile("rb") as replies:
                send_frame(self.sock, FINISH, json.dumps({"timeout": timeout, "stream": stream is not None}).encode())
                send_frame(self.sock, DATA, input or b"")
                return self._result(replies, stream, check)
        except OSError as exc:
            raise ConnectError(f"connection lost while running {self.argv[0]}: {exc}", host=name) from None
        except ValueError as exc:
            raise RemoteCommandError(f"the connection master sent a bad reply: {exc}", host=name) from None
        finally:
            self.conn._track(self.sock, False)

    def _result(self, replies, stream: Stream | None, check: bool) -> RunResult:
        name = self.conn.name
        while (frame := read_frame(replies)) is not None:
            kind, payload = frame
            if kind == LINE and stream is not None:
                stream(payload.decode(errors="replace"))
            elif kind == RESULT:
                return check_result(name, self.argv, RunResult(**json.loads(payload)), check)
            elif kind == ERROR:
                err = json.loads(payload)
                raise error_for(str(err.get("kind")), str(err.get("message")), name)
        raise ConnectError(f"connection lost while running {self.argv[0]}: the kept connection closed", host=name)
