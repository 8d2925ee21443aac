"""The connection master: keeps SSH connections open for later commands (see control.py).

    python -c "import sys; sys.path[:] = [...]; from deployer.transport.control_master import main; main()"
        < {"persist": S, "timeouts": {...}, "hosts": [...]}          (master_start.py starts it)

Started by a command, in a session of its own. It connects every host it was given, each in its
own thread, as a command would (SSHConnection); reports each on stdout as one JSON line as soon as
it is connected ({"host": NAME, "error": null}) or has failed ({"host": NAME, "error": LINE}),
listening on the host's socket before it says so; closes stdout once all are reported; then
serves the sockets. A host's connection closes `persist` seconds after its last command, when
its link drops, or when a check before a command finds that a fresh connect would not use it
(control.py); at STOP it takes no new command (its socket goes) and closes when its running
commands end. The process exits after its last host, and removes its log (its stderr, in the
socket directory) if nothing was written to it. Nothing of it runs on a host between commands.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ConnectError, DeployError
from . import ssh
from .endpoint import SSHEndpoint
from .known_hosts import KnownHosts
from .peer_creds import peer_uid
from .ssh_connection import SSHConnection
from .timeouts import Timeouts
from .wire import DATA, ERROR, FINISH, HELLO, LINE, OK, RESULT, START, STOP, error_frame, read_frame, send_frame

IDLE_CHECK = 0.5  # seconds between looks at the idle connections


class KeptHost:
    """One host's kept connection and the socket that serves it."""

    def __init__(self, host: SSHEndpoint, path: Path, conn: SSHConnection, persist: float):
        self.host, self.path, self.conn, self.persist = host, path, conn, persist
        self.lock = threading.Lock()
        self.active, self.last, self.closed, self.stopping = 0, time.monotonic(), False, False
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
            if not _own_user(client):
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
                done = self.stopping and self.active == 0
            if done:
                self.close()

    def stop(self) -> int:
        """As `ssh -O stop`: no new command (the socket goes, so the next command starts a new
        master); the connection closes when its running commands end. How many still run."""
        with self.lock:
            self.stopping = True
            running = self.active
        self._unlisten()
        if not running:
            self.close()
        return running

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
        self._unlisten()
        self.conn.close()

    def _unlisten(self) -> None:
        try:
            if self.path.stat().st_ino == self.inode:  # still ours, not a newer master's
                self.path.unlink()
        except OSError:
            pass
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread, which then ends
        except OSError:
            pass
        self.listener.close()

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
        with client, client.makefile("rb") as frames:
            try:
                first = read_frame(frames)
                if first is not None:
                    self._request(client, frames, *first)
            except OSError:
                pass  # the client went away; its command, if any, was closed

    def _request(self, client: socket.socket, frames, kind: bytes, payload: bytes) -> None:
        if kind == STOP:
            running = self.stop()
            send_frame(client, OK, json.dumps({"host": self.host.name, "running": running}).encode())
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
        with self.busy():
            try:
                started = self._start(json.loads(payload), data[1])
            except DeployError as exc:
                send_frame(client, ERROR, error_frame(exc))
                return
            self._serve(client, frames, started)

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

    def _start(self, spec: dict[str, Any], first_input: bytes):
        """`spec` (a START's JSON) started on a new channel."""
        argv, cwd, env, hold = spec["argv"], spec["cwd"], spec["env"], spec["hold_stdin"]
        return self.conn.start(argv, cwd=cwd, env=env, first_input=first_input, hold_stdin=hold)


def _close_when_gone(frames, chan, done: threading.Event) -> None:
    """The client sends nothing after FINISH: end of stream means it has gone, and its command's
    channel closes (the remote command sees the end of its stdin, as at a cut link)."""
    try:
        frames.read(1)
    except (OSError, ValueError):  # the handler closed the stream: the command had ended
        pass
    if not done.is_set():
        chan.close()


def _own_user(client: socket.socket) -> bool:
    """Whether the client runs as this user, where the platform can tell (peer_creds.py); where
    it cannot, the socket directory's 0700 mode has let only this user reach the socket."""
    try:
        uid = peer_uid(client)
    except OSError:
        return False  # the call exists and failed: refuse this client, serve the next
    return uid is None or uid == os.getuid()


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
    _remove_if_empty(Path(request["log"]) if request.get("log") else None)


def _remove_if_empty(log: Path | None) -> None:
    """The master's log, once it ends: kept only when something was written to it."""
    try:
        if log is not None and log.stat().st_size == 0:
            log.unlink()
    except OSError:
        pass


if __name__ == "__main__":
    main()
