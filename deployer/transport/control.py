"""Connections kept open between commands, as OpenSSH's ControlMaster and ControlPersist keep them.

A command that needs SSH hosts with no kept connection starts one connection master for them
(control_master.py, started by master_start.py with this process's import path). It connects
exactly as a command does (ssh.py: ssh_config, ProxyJump, strict host keys, retries), then
listens on one Unix socket per host. Commands reach the host through that socket
(shared_connection.py): each command they run is one socket connection, on which the master
opens a channel of its SSH transport, streams back the command's stderr lines and finally its
result. A client that goes away (Ctrl-C, killed) closes its socket and the master closes the
channel, so the remote command sees the end of its stdin as it would see a cut link. The client
never loads paramiko or Fabric, and pays no handshake, no authentication and no host-key lookup.
Nothing runs on a host between commands: the master keeps a connection, not a process.

    connector = Connector(hosts)          # one master starts for the hosts without a kept connection
    conn = connector.open(host)           # a SharedConnection (raises ConnectError as a connect does)
    conn.start(argv, first_input=b"...").finish(b"...")

A master that cannot start, or ends before connecting a host, leaves that host to a direct
connection of the command's own (OpenSSH's `ControlMaster auto`), with a one-line note naming the
master's log. A kept connection is named by a hash of the host's whole inventory entry and of the
settings that choose its ssh_config files (control_paths.py). Before every command the master
checks the connection as a fresh connect would (its ssh_config options and every hop's key); if
it fails, it closes that connection and the command connects anew. A master closes a host's
connection DDEPLOY_CONTROL_PERSIST seconds after its last command (default 60), when the link
drops, or at `ddeploy disconnect` (as `ssh -O stop`: it takes no new command, and closes when its
running commands end), and exits after its last one.

The sockets live in a directory private to the user (control_paths.py, made 0700); the master
serves only its own user where the platform names a socket's peer (peer_creds.py), and relies on
the directory's mode elsewhere, as OpenSSH does. DDEPLOY_CONTROL_PERSIST=0 turns reuse off; a
command that may record new host keys (--accept-new-host-keys) always connects itself.
"""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .command import Connection
from .control_paths import MAX_SOCKET_PATH, connection_name, control_dir, persist_seconds, socket_in
from .direct import open_direct
from .master_start import MasterStart
from .shared_connection import SharedConnection, dial
from .timeouts import Timeouts
from .wire import HELLO, OK, STOP, read_frame, send_frame

if TYPE_CHECKING:
    from ..inventory import Host

__all__ = ["Connector", "SharedConnection", "Stopped", "connection_name", "disconnect", "stop_masters"]


@dataclass(frozen=True)
class Stopped:
    """A kept connection told to stop: its host, and how many commands still run on it."""

    host: str
    running: int


def _ask(path: Path, kind: bytes) -> bytes | None:
    """Send HELLO or STOP to the master at `path`: its OK's payload (HELLO: the connection passed
    the checks of a fresh connect and serves the next command), else None."""
    try:
        sock = dial(path)
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
    return frame[1] if frame is not None and frame[0] == OK else None


def _stopped(payload: bytes) -> Stopped:
    reply = json.loads(payload)
    return Stopped(str(reply["host"]), int(reply["running"]))


def stop_masters(hosts: list[Host] | None = None) -> list[Stopped]:
    """Stop the kept connections (of `hosts`, else every one of this user's), as `ssh -O stop`:
    each takes no new command and closes when its running commands end. A socket that no master
    listens on any more (its master was killed before it could remove it) is removed."""
    directory = control_dir()
    remote = [h for h in hosts if not h.is_local] if hosts is not None else None
    paths = sorted(directory.glob("*.sock")) if remote is None else [socket_in(directory, h) for h in remote]
    stopped = []
    for path in paths:
        payload = _ask(path, STOP)
        if payload is not None:
            stopped.append(_stopped(payload))
        else:
            _remove_if_dead(path)
    return stopped


def disconnect(hosts: list[Host] | None = None) -> list[str]:
    """stop_masters, in words: each host's name, with "(closes when its N running command(s)
    end)" where commands still run on it."""
    return [
        s.host if not s.running else f"{s.host} (closes when its {s.running} running command(s) end)"
        for s in stop_masters(hosts)
    ]


def _remove_if_dead(path: Path) -> None:
    """Remove the socket at `path` if connecting to it is refused: its master is gone. A master
    started since replaces the path with a socket of its own (another inode), which stays."""
    try:
        before = path.lstat()
        if not stat.S_ISSOCK(before.st_mode):
            return
        live = dial(path)
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
        self._master: MasterStart | None = None
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
            self._master = MasterStart(missing, paths, persist, self.timeouts, directory)

    def open(self, host: Host) -> Connection:
        """The host's connection (raises ConnectError); closing it leaves a kept one open."""
        if host.name in self.paths and self._master is not None and host.name in self._master.names:
            gone = self._master.wait(host)
            if gone is not None:
                print(f"[{host.name}] {gone}", file=sys.stderr)
                del self.paths[host.name]
        if host.name not in self.paths:  # this machine, reuse is off, or no master
            return open_direct(host, accept_new_host_keys=self.accept_new_host_keys, timeouts=self.timeouts)
        return SharedConnection(host, self.paths[host.name], self.timeouts, reopen=lambda: self._reopen(host))

    def _reopen(self, host: Host) -> Connection:
        """The host's connection for a command that found its kept one closed since."""
        return Connector([host], timeouts=self.timeouts).open(host)
