"""The connection master: keeps SSH connections open for later commands (see control.py).

    python -I -m deployer.transport.control_master   < {"persist": S, "timeouts": {...}, "hosts": [...]}

Started by a command, in a session of its own. It connects every host it was given, each in its
own thread, as a command would (SSHConnection); reports each on stdout as one JSON line as soon as
it is connected ({"host": NAME, "error": null}) or has failed ({"host": NAME, "error": LINE}),
listening on the host's socket before it says so; closes stdout once all are reported; then
serves the sockets. A host's connection closes `persist` seconds after its last command, at QUIT,
when its link drops, or when a check before a command finds that a fresh connect would not use it
(control.py); the process exits after its last host. After a command started with `standby`,
the next one like it is started ahead (KeptHost._keep_standby).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paramiko

from ..errors import ConnectError, DeployError
from . import ssh
from .wire import DATA, ERROR, FINISH, HELLO, LINE, OK, QUIT, RESULT, START, error_frame, read_frame, send_frame
from .endpoint import SSHEndpoint
from .known_hosts import KnownHosts
from .ssh_connection import SSHConnection
from .timeouts import Timeouts

IDLE_CHECK = 0.5  # seconds between looks at the idle connections


class KeptHost:
    """One host's kept connection and the socket that serves it."""

    def __init__(self, host: SSHEndpoint, path: Path, conn: SSHConnection, persist: float):
        self.host, self.path, self.conn, self.persist = host, path, conn, persist
        self.lock = threading.Lock()
        self.active, self.last, self.closed = 0, time.monotonic(), False
        # The next standby command, started ahead: (what it runs, as standby_key gives it, the
        # command), and whether one is being started.
        self.standby: tuple[str, Any] | None = None
        self.standby_starting = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.unlink(missing_ok=True)
        self.listener.bind(str(staging))
        os.chmod(staging, 0o600)
        self.listener.listen(16)
        os.replace(staging, path)  # atomically: a master started beside this one is replaced
        self.inode = path.stat().st_ino

    def serve(self) -> None:
        threading.Thread(target=self._accept, name=f"accept-{self.host.name}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if _peer_uid(client) != os.getuid():
                client.close()
                continue
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    @contextmanager
    def busy(self):
        with self.lock:
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()

    def idle_out(self) -> bool:
        """Close when unused for `persist` seconds, or when the link has dropped; whether closed."""
        with self.lock:
            idle = self.active == 0 and time.monotonic() - self.last > self.persist
        if idle or not self.conn.transport.is_active():
            self.close()
        return self.closed

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        try:
            if self.path.stat().st_ino == self.inode:  # still ours, not a newer master's
                self.path.unlink()
        except OSError:
            pass
        self.listener.close()
        self.conn.close()

    def trusted(self) -> bool:
        """Whether a fresh connect would use this connection: the link is up, the ssh_config still
        gives every hop the options it connected with, and every hop's key is still trusted."""
        if self.closed or not self.conn.transport.is_active():
            return False
        try:
            fresh = ssh.ssh_config_for(self.host, self.conn.timeouts).base_ssh_config
            for hop in ssh.hops(self.conn.fabric):
                if fresh.lookup(hop.original_host) != hop.ssh_config:
                    return False
                key = hop.transport.get_remote_server_key()
                KnownHosts.for_hop(hop).policy(accept_new=False).missing_host_key(None, hop.host, key)
        except Exception:  # noqa: BLE001 - any doubt: the command connects anew and reports it
            return False
        return True

    def _handle(self, client: socket.socket) -> None:
        with self.busy(), client, client.makefile("rb") as frames:
            try:
                self._command(client, frames)
            except OSError:
                pass  # the client went away; its command, if any, was closed

    def _command(self, client: socket.socket, frames) -> None:
        first = read_frame(frames)
        if first is None:
            return
        kind, payload = first
        if kind == QUIT:
            self.close()
            send_frame(client, OK, self.host.name.encode())
            return
        if not self.trusted():
            self.close()  # a fresh connect decides (and reports) what the host is now
            send_frame(client, ERROR, error_frame(ConnectError("the kept connection is stale; connect again")))
            return
        if kind == HELLO:
            send_frame(client, OK, self.host.name.encode())
            return
        data = read_frame(frames)
        if kind != START or data is None or data[0] != DATA:
            return
        spec: dict[str, Any] = json.loads(payload)
        key = standby_key(spec) if spec.get("standby") else None
        try:
            started = self._take_standby(key, data[1]) if key else None
            if started is None:
                started = self._start(spec, data[1])
        except DeployError as exc:
            send_frame(client, ERROR, error_frame(exc))
            return
        try:
            self._serve(client, frames, started)
        finally:
            if key:
                self._keep_standby(spec, key)

    def _serve(self, client: socket.socket, frames, started) -> None:
        """The started command's FINISH, its stderr lines and its result."""
        finish, rest = read_frame(frames), read_frame(frames)
        if finish is None or finish[0] != FINISH or rest is None or rest[0] != DATA:
            started.chan.close()  # the client went away before sending the rest
            return
        opts = json.loads(finish[1])
        done = threading.Event()
        watcher = threading.Thread(target=_close_when_gone, args=(frames, started.chan, done), daemon=True)
        watcher.start()
        stream = (lambda line: send_frame(client, LINE, line.encode())) if opts.get("stream") else None
        try:
            res = started.finish(rest[1], check=False, timeout=opts.get("timeout"), stream=stream)
        except DeployError as exc:
            send_frame(client, ERROR, error_frame(exc))
        else:
            reply = {"rc": res.rc, "stdout": res.stdout, "stderr": res.stderr, "signal": res.signal}
            send_frame(client, RESULT, json.dumps(reply).encode())
        finally:
            done.set()
            client.shutdown(socket.SHUT_RDWR)  # wakes the watcher

    def _open(self, spec: dict[str, Any], first_input: bytes = b""):
        """`spec` (a START's JSON) started on a new channel."""
        return self.conn.start(
            spec["argv"], cwd=spec["cwd"], env=spec["env"], first_input=first_input, hold_stdin=spec["hold_stdin"]
        )

    def _start(self, spec: dict[str, Any], first_input: bytes):
        """The command started on a channel of its own. An sshd that allows few sessions per
        connection (MaxSessions) may refuse the channel that the standby's would make one too
        many: the standby then ends, and the command takes its place."""
        try:
            return self._open(spec, first_input)
        except DeployError:
            with self.lock:
                held, self.standby = self.standby, None
            if held is None:
                raise
        _end(held[1].chan)
        return self._open(spec, first_input)

    def _take_standby(self, key: str, first_input: bytes):
        """The standby command started ahead for `key`, given its first input; None if there is
        none (or it has ended: the command is then started as any other)."""
        with self.lock:
            if self.standby is None or self.standby[0] != key:
                return None
            started, self.standby = self.standby[1], None
        try:
            if started.chan.exit_status_ready():
                raise EOFError("it has ended")
            if first_input:
                started.chan.sendall(first_input)
        except (OSError, EOFError, paramiko.SSHException):
            started.chan.close()
            return None
        return started

    def _keep_standby(self, spec: dict[str, Any], key: str) -> None:
        """Start the next command like `spec` now, in the background, so that it has started (the
        host's login shell, the interpreter) by the time a command asks for it. One per host: a
        standby for another command is closed (its process reads end of file and ends)."""
        with self.lock:
            if self.closed or self.standby_starting or (self.standby is not None and self.standby[0] == key):
                return
            self.standby_starting = True
        threading.Thread(target=self._start_standby, args=(spec, key), name="standby", daemon=True).start()

    def _start_standby(self, spec: dict[str, Any], key: str) -> None:
        try:
            started = self._open(spec)
        except DeployError:
            started = None  # the next command starts its own, and reports what is wrong
        with self.lock:
            self.standby_starting = False
            replaced = None
            if started is not None and not self.closed:
                replaced, self.standby, started = self.standby, (key, started), None
        for left in (started, replaced and replaced[1]):
            if left is not None:
                _end(left.chan)


def _end(chan: paramiko.Channel, wait: float = 2.0) -> None:
    """End a standby: the end of its stdin (it has read nothing, so it exits), its exit awaited
    (a little while) so that sshd has freed its session before the next channel opens."""
    try:
        chan.shutdown_write()
        deadline = time.monotonic() + wait
        while not chan.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.01)
    except (OSError, EOFError, paramiko.SSHException):
        pass
    chan.close()


def standby_key(spec: dict[str, Any]) -> str:
    """What a standby command runs: only a command that asks for exactly that may take it."""
    return json.dumps([spec["argv"], spec["cwd"], spec["env"], spec["hold_stdin"]], sort_keys=True)


def _close_when_gone(frames, chan, done: threading.Event) -> None:
    """The client sends nothing after FINISH: end of stream means it has gone, and its command's
    channel closes (the remote command sees the end of its stdin, as at a cut link)."""
    try:
        frames.read(1)
    except (OSError, ValueError):  # the handler closed the stream: the command had ended
        pass
    if not done.is_set():
        chan.close()


def _peer_uid(client: socket.socket) -> int:
    creds = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _connect(entry: dict[str, Any], persist: float, timeouts: Timeouts, report) -> KeptHost | None:
    name = str(entry.get("endpoint", {}).get("name", "?"))
    try:
        host = SSHEndpoint.from_json(entry["endpoint"])
        conn = SSHConnection(host, timeouts=timeouts)
    except DeployError as exc:
        report(name, exc.args[0] if exc.args else str(exc))
        return None
    except Exception as exc:  # noqa: BLE001 - one line to the command, never a traceback
        report(name, f"the connection master could not connect: {exc}")
        return None
    try:
        kept = KeptHost(host, Path(entry["path"]), conn, persist)
    except OSError as exc:
        conn.close()
        report(name, f"cannot listen on {entry['path']}: {exc.strerror or exc}")
        return None
    kept.serve()
    report(name, None)
    return kept


def main() -> None:
    logging.getLogger("paramiko").addHandler(logging.NullHandler())  # each failure is one reported line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    request = json.loads(sys.stdin.buffer.read())
    persist = float(request["persist"])
    # Each command brings its own time limit (FINISH); the one of the command that started this
    # master is not every later command's.
    timeouts = Timeouts(**{**request["timeouts"], "command": None})
    lock = threading.Lock()

    def report(name: str, error: str | None) -> None:
        with lock:
            try:
                sys.stdout.write(json.dumps({"host": name, "error": error}) + "\n")
                sys.stdout.flush()
            except OSError:
                pass  # the command has gone; its hosts are kept all the same

    kept: list[KeptHost] = []
    threads = []
    for entry in request["hosts"]:

        def connect(entry=entry) -> None:
            one = _connect(entry, persist, timeouts, report)
            if one is not None:
                with lock:
                    kept.append(one)

        threads.append(threading.Thread(target=connect, daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    try:
        sys.stdout.close()
    except OSError:
        pass
    while kept:
        time.sleep(IDLE_CHECK)
        kept = [k for k in kept if not k.idle_out()]


if __name__ == "__main__":
    main()
