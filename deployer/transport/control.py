"""Connections kept open between commands, as OpenSSH's ControlMaster and ControlPersist keep them.

A command that needs SSH hosts with no kept connection starts one connection master for them
(control_master.py, a detached `python -I -m deployer.transport.control_master`). It connects
exactly as a command does (ssh.py: ssh_config, ProxyJump, strict host keys, retries), then
listens on one Unix socket per host. Commands reach the host through that socket: each command
they run is one socket connection, on which the master opens a channel of its SSH transport,
streams back the command's stderr lines and finally its result. A client that goes away (Ctrl-C,
killed) closes its socket and the master closes the channel, so the remote command sees the end
of its stdin as it would see a cut link. The client never loads paramiko or Fabric, and pays no
handshake, no authentication and no host-key lookup of its own.

    connector = Connector(hosts)          # one master starts for the hosts without a kept connection
    conn = connector.open(host)           # a SharedConnection (raises ConnectError as a connect does)
    conn.start(argv, first_input=b"...").finish(b"...")

A command that does nothing before it has read its input (the agent: `start(..., standby=True)`)
is started ahead: after running one, the master starts the next command like it on a channel of
its own, where it waits (the host's login shell and interpreter already started) until a command
asks for exactly that argv, cwd and environment; it then gets that command's input. One standby per
host; a command of another kind replaces it after running, and it ends with the connection.

A kept connection is named by a hash of the host's whole inventory entry and of the settings that
choose its ssh_config files, so a changed address, user, port, jump host or config is another
connection. Before every command the master checks the connection as a fresh connect would: the
ssh_config still gives every hop the options it connected with, and every hop's key is still
trusted by its known-hosts files; if not, it closes that connection and the command connects
anew (a revoked or changed key is then refused as it would be without reuse). A master closes a
host's connection DDEPLOY_CONTROL_PERSIST seconds after its last command (default 60, Ansible's
ControlPersist), at `ddeploy disconnect`, or when the link drops, and exits after its last one.

The sockets live in a directory private to the user: $DDEPLOY_CONTROL_DIR, else
$XDG_RUNTIME_DIR/ddeploy, else /tmp/ddeploy-UID; made 0700, and refused when another user owns
it or may write it. The master serves only its own user (SO_PEERCRED). DDEPLOY_CONTROL_PERSIST=0
turns reuse off: each command connects itself and disconnects at its end, as before. A command
that may record new host keys (--accept-new-host-keys) always connects itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConnectError, RemoteCommandError
from .command import Connection, RunResult, StartedCommand, Stream, check_result
from .timeouts import Timeouts
from .wire import DATA, ERROR, FINISH, HELLO, LINE, OK, QUIT, RESULT, START, WIRE, read_frame, send_frame

if TYPE_CHECKING:
    from ..inventory import Host

DEFAULT_PERSIST = 60.0  # seconds, as Ansible's ControlPersist
# The environment that chooses a host's ssh_config files (ssh.py): part of a connection's name.
CONFIG_SETTINGS = ("DDEPLOY_SSH_CONFIG", "DDEPLOY_SYSTEM_SSH_CONFIG", "DDEPLOY_USER_SSH_CONFIG", "HOME")
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def persist_seconds() -> float:
    """DDEPLOY_CONTROL_PERSIST: how long a connection stays open after its last command (0: off)."""
    raw = os.environ.get("DDEPLOY_CONTROL_PERSIST")
    if not raw:
        return DEFAULT_PERSIST
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 86400:  # also refuses nan and inf
        raise ConnectError(
            f"DDEPLOY_CONTROL_PERSIST={raw!r} is not a number of seconds between 0 and 86400 "
            f"(0 turns connection reuse off)"
        )
    return value


def control_dir() -> Path:
    """The user's private socket directory (created 0700); refused when it is not private."""
    explicit = os.environ.get("DDEPLOY_CONTROL_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if explicit:
        path = Path(explicit)
    elif runtime:
        path = Path(runtime) / "ddeploy"
    else:
        path = Path(tempfile.gettempdir()) / f"ddeploy-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=bool(explicit), exist_ok=True)
        info = path.lstat()  # a symlink planted in /tmp is not followed
    except OSError as exc:
        raise ConnectError(f"cannot use the connection directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConnectError(
            f"the connection directory {path} is not private to this user (owner uid {info.st_uid}, "
            f"mode {stat.S_IMODE(info.st_mode):o}{'' if stat.S_ISDIR(info.st_mode) else ', not a directory'}); "
            f"remove it, or set DDEPLOY_CONTROL_PERSIST=0"
        )
    return path


def connection_name(host: Host) -> str:
    """The kept connection's name: a hash of everything that decides where and how it connects."""
    identity = host.ssh.identity if host.ssh else None
    entry = {
        "wire": WIRE,
        "host": host.model_dump(mode="json"),
        "source": _absolute_source(host),  # its directory finds the host's ssh_config
        "identity": os.path.abspath(os.path.expanduser(identity)) if identity else None,
        "settings": {k: os.environ.get(k) for k in CONFIG_SETTINGS},
    }
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:24]


def _absolute_source(host: Host) -> str:
    return host.source if host.source.startswith("<") else os.path.abspath(host.source)


def socket_in(directory: Path, host: Host) -> Path:
    return directory / f"{connection_name(host)}.sock"


def _raise_error(payload: bytes, host: str) -> None:
    from . import agent_client

    err = json.loads(payload)
    raise agent_client.error_for(str(err.get("kind")), str(err.get("message")), host)


def _dial(path: Path) -> socket.socket | None:
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


def _ask(path: Path, kind: bytes) -> str | None:
    """Send HELLO or QUIT to the master at `path`: the host's name if it answered OK (HELLO: its
    connection passed the checks of a fresh connect and serves the next command), else None."""
    try:
        sock = _dial(path)
    except OSError:
        return None
    if sock is None:
        return None
    with sock, sock.makefile("rb") as answers:
        try:
            send_frame(sock, kind)
            frame = read_frame(answers)
        except OSError:
            return None
    return frame[1].decode(errors="replace") if frame is not None and frame[0] == OK else None


def disconnect(hosts: list[Host] | None = None) -> list[str]:
    """Close the kept connections (of `hosts`, else every one of this user's); the names of the
    hosts whose connection was open. A socket that no master listens on any more (its master was
    killed before it could remove it) is removed."""
    directory = control_dir()
    paths = (
        sorted(directory.glob("*.sock"))
        if hosts is None
        else [socket_in(directory, h) for h in hosts if not h.is_local]
    )
    closed = []
    for path in paths:
        name = _ask(path, QUIT)
        if name is not None:
            closed.append(name)
        else:
            _remove_if_dead(path)
    return closed


def _remove_if_dead(path: Path) -> None:
    """Remove the socket at `path` if connecting to it is refused: its master is gone. A master
    started since replaces the path with a socket of its own (another inode), which stays."""
    try:
        before = path.lstat()
        if not stat.S_ISSOCK(before.st_mode):
            return
        live = _dial(path)
    except OSError:
        return
    if live is not None:  # a master listens after all: not a dead one's socket
        live.close()
        return
    try:
        if path.lstat().st_ino == before.st_ino:
            path.unlink()
    except OSError:
        pass


class Connector:
    """Connections for the hosts of one command: kept ones where reuse is on (one master started
    for every host without one, connecting them all at once), else the command's own."""

    def __init__(self, hosts: list[Host], *, accept_new_host_keys: bool = False, timeouts: Timeouts | None = None):
        self.timeouts = timeouts or Timeouts.from_env()
        self.accept_new_host_keys = accept_new_host_keys
        self.paths: dict[str, Path] = {}  # the hosts reached through kept connections (none: reuse off)
        self._master: _MasterStart | None = None
        remote = {h.name: h for h in hosts if not h.is_local}
        if accept_new_host_keys or not remote:
            return
        persist = persist_seconds()  # read only where it matters: a bad value fails SSH commands only
        if not persist:
            return
        directory = control_dir()
        paths = {name: socket_in(directory, h) for name, h in remote.items()}
        if any(len(str(p)) > MAX_SOCKET_PATH for p in paths.values()):
            return  # a socket path the OS cannot hold: connect as without reuse
        self.paths = paths
        missing = [h for name, h in remote.items() if _ask(paths[name], HELLO) is None]
        if missing:
            self._master = _MasterStart(missing, paths, persist, self.timeouts)

    def open(self, host: Host) -> Connection:
        """The host's connection (raises ConnectError); closing it leaves a kept one open."""
        if host.name not in self.paths:  # this machine, or reuse is off
            from .connection import open_direct

            return open_direct(host, accept_new_host_keys=self.accept_new_host_keys, timeouts=self.timeouts)
        if self._master is not None and host.name in self._master.names:
            self._master.wait(host)
        return SharedConnection(host, self.paths[host.name], self.timeouts)


class _MasterStart:
    """A connection master being started for some hosts: it reports each host on its stdout as
    one JSON line ({"host", "error"}) as soon as that host is connected or has failed."""

    def __init__(self, hosts: list[Host], paths: dict[str, Path], persist: float, timeouts: Timeouts):
        from dataclasses import asdict, replace

        from .endpoint import SSHEndpoint

        request = {
            "persist": persist,
            "timeouts": asdict(timeouts),
            "hosts": [
                {
                    "endpoint": replace(SSHEndpoint.of(h), source=_absolute_source(h)).to_json(),
                    "path": str(paths[h.name]),
                }
                for h in hosts
            ],
        }
        self.names = {h.name for h in hosts}  # the hosts this master connects
        self._done: dict[str, str | None] = {}  # host -> None (connected) or its error line
        self._ended = False  # the master's stdout closed
        self._cond = threading.Condition()
        # A session of its own: the terminal's Ctrl-C stops the command, not the connections it keeps.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "deployer.transport.control_master"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._proc.stdin.write(json.dumps(request).encode())
        self._proc.stdin.close()
        threading.Thread(target=self._read, name="control-master", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                report = json.loads(line)
                name, error = str(report["host"]), report.get("error")
            except (ValueError, KeyError, TypeError):
                continue
            with self._cond:
                self._done[name] = None if error is None else str(error)
                self._cond.notify_all()
        self._proc.stdout.close()  # every host reported, or the master ended
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, host: Host) -> None:
        """Until the master has connected `host` (raises its ConnectError, one line)."""
        with self._cond:
            while host.name not in self._done and not self._ended:
                self._cond.wait()
            if host.name not in self._done:
                code = self._proc.poll()
                how = f"exit status {code}" if code is not None else "its output closed"
                raise ConnectError(
                    f"the connection master ended ({how}) before connecting; run the command again, "
                    f"or set DDEPLOY_CONTROL_PERSIST=0",
                    host=host.name,
                )
            error = self._done[host.name]
        if error is not None:
            raise ConnectError(error, host=host.name)


class SharedConnection(Connection):
    """A host reached through its kept connection: one socket connection per command."""

    def __init__(self, host: Host, path: Path, timeouts: Timeouts):
        self.host, self.path, self.timeouts = host, path, timeouts
        self._lock = threading.Lock()
        self._running: set[socket.socket] = set()  # the sockets of commands not finished yet

    def close(self) -> None:
        """Cut the commands still running, as closing a connection of the command's own would:
        their channels close and a `finish` waiting on one raises ConnectError. The kept
        connection stays open for the next command."""
        with self._lock:
            running, self._running = list(self._running), set()
        for sock in running:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _track(self, sock: socket.socket, running: bool) -> None:
        with self._lock:
            (self._running.add if running else self._running.discard)(sock)

    def start(self, argv, *, cwd=None, env=None, first_input=b"", hold_stdin=False, standby=False) -> StartedCommand:
        sock = None
        try:
            sock = _dial(self.path)
            if sock is None:  # it closed since (idle, the link dropped): this command connects anew
                Connector([self.host], timeouts=self.timeouts).open(self.host)
                sock = _dial(self.path)
            if sock is None:
                raise OSError("no connection master listens")
            command = {
                "argv": [str(a) for a in argv],
                "cwd": cwd,
                "env": env,
                "hold_stdin": hold_stdin,
                "standby": standby,
            }
            self._track(sock, True)
            send_frame(sock, START, json.dumps(command).encode())
            send_frame(sock, DATA, first_input)
        except OSError as exc:
            if sock is not None:
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
                while (frame := read_frame(replies)) is not None:
                    kind, payload = frame
                    if kind == LINE and stream is not None:
                        stream(payload.decode(errors="replace"))
                    elif kind == RESULT:
                        res = RunResult(**json.loads(payload))
                        return check_result(name, self.argv, res, check)
                    elif kind == ERROR:
                        _raise_error(payload, name)
        except OSError as exc:
            raise ConnectError(f"connection lost while running {self.argv[0]}: {exc}", host=name) from None
        except ValueError as exc:
            raise RemoteCommandError(f"the connection master sent a bad reply: {exc}", host=name) from None
        finally:
            self.conn._track(self.sock, False)
        raise ConnectError(f"connection lost while running {self.argv[0]}: the kept connection closed", host=name)
