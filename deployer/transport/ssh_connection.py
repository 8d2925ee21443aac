"""An SSH host as a Connection: the fabric.Connection chain (ssh.py) and commands on its channels.

Commands run on the connection's paramiko channels, not Fabric's run(): the agent protocol sends
stdin in two parts (the program at start, the request later), streams stderr lines as progress
while the command runs, and tells a killed process from a cut connection.
"""

from __future__ import annotations

import shlex
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from paramiko.ssh_exception import SSHException

from ..errors import ConnectError, RemoteCommandError
from .command import Connection, LineSplitter, RunResult, StartedCommand, Stream, check_result, env_prefix
from .command import UNKNOWN_SIGNAL, quote_argv, signal_rc
from .connect_errors import attempts_note, describe_connect_error
from .endpoint import SSHEndpoint
from .retries import Timeouts, with_retries

if TYPE_CHECKING:
    from ..inventory import Host


class SSHConnection(Connection):
    """An SSH host: a fabric.Connection (deployer/transport/ssh.py: ssh_config, ProxyJump hops,
    strict host keys on every hop). `host` is the inventory's Host or its SSHEndpoint."""

    def __init__(
        self, host: Host | SSHEndpoint, *, accept_new_host_keys: bool = False, timeouts: Timeouts | None = None
    ):
        from . import ssh

        host = SSHEndpoint.of(host)  # all the SSH layer reads of an inventory host
        self.host, self.timeouts = host, timeouts or Timeouts()
        if host.ssh.identity and not Path(host.ssh.identity).expanduser().is_file():
            raise ConnectError(
                f"identity file {Path(host.ssh.identity).expanduser()} (ssh.identity in {host.source}) does not "
                f"exist; fix the path or create the key",
                host=host.name,
            )
        self.config = ssh.ssh_config_for(host, self.timeouts)
        self.fabric = self._chain(accept_new_host_keys)  # the target: user, host, port, gateway
        try:
            self.fabric, _ = with_retries(lambda: self._open_fresh(accept_new_host_keys), self.timeouts)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
            where = getattr(exc, "hop", None) or ssh.target(self.fabric)
            message = describe_connect_error(exc, where) + attempts_note(exc)
            raise ConnectError(message, host=self.name) from None
        self.transport = self.fabric.transport
        # every hop's ServerAliveInterval x ServerAliveCountMax: a dead link is closed, not waited on
        self.keepalives = [watch for hop in ssh.hops(self.fabric) if (watch := ssh.keep_alive(hop))]

    def _chain(self, accept_new: bool):
        from . import ssh

        try:
            return ssh.connection_chain(self.config, self.host, self.timeouts, accept_new_host_keys=accept_new)
        except (paramiko.SSHException, ValueError) as exc:  # `Port abc`, a bad ProxyJump port, ...
            raise ssh.config_error(self.host, exc) from None

    def _open_fresh(self, accept_new: bool):
        """One attempt at the whole chain, with new clients, each hop opened in turn (so a failure
        names its hop: exc.hop); a failed attempt leaves none open."""
        from . import ssh

        conn = self._chain(accept_new)
        for hop in ssh.hops(conn):
            try:
                hop.open()  # a hop after the first goes through the one before it (Fabric's gateway)
            except BaseException as exc:
                ssh.close_chain(conn)
                exc.hop = ssh.describe_hop(hop, conn)  # type: ignore[attr-defined]
                raise
        return conn

    def run(self, argv, *, cwd=None, env=None, check=True, timeout=None, stream=None, input=None, hold_stdin=False):
        started = self.start(argv, cwd=cwd, env=env, hold_stdin=hold_stdin)
        return started.finish(input, check=check, timeout=timeout, stream=stream)

    def start(self, argv, *, cwd=None, env=None, first_input=b"", hold_stdin=False):
        line = remote_line([*env_prefix({**self.host.env, **(env or {})}), *argv], cwd)
        try:
            chan = self._open_session()
            chan.exec_command(line)
            if first_input:
                chan.sendall(first_input)
        except paramiko.ChannelException as exc:  # refused twice; the connection itself is up
            raise ConnectError(
                f"sshd refused a new session to run {argv[0]} ({exc.text}); its MaxSessions may all be in use",
                host=self.name,
            ) from None
        except (SSHException, OSError, EOFError) as exc:
            raise self.lost(argv, exc) from None
        return _StartedChannel(self, argv, chan, hold_stdin)

    def _open_session(self) -> paramiko.Channel:
        """A new session channel. sshd counts a channel we have closed against MaxSessions until
        it has read our close and then passed over its channels, so an open sent right after a
        close may be refused; it is sent once more, and only once: OpenSSH writes the refusal
        after that pass, so by then a session freed by our close is free."""
        try:
            return self.transport.open_session()
        except paramiko.ChannelException:
            return self.transport.open_session()

    def lost(self, argv: list[str], exc: BaseException) -> ConnectError:
        """The connection broke under argv: why, in one line (a keepalive's verdict when it closed the link)."""
        why = next((w.reason for w in getattr(self, "keepalives", []) if w.reason), None)
        return ConnectError(f"connection lost while running {argv[0]}: {why or exc or type(exc).__name__}",
                            host=self.name)  # fmt: skip

    def close(self) -> None:
        from . import ssh

        for watch in getattr(self, "keepalives", []):
            watch.stop()
        if getattr(self, "transport", None) is not None:
            ssh.close_chain(self.fabric)


class _StartedChannel(StartedCommand):
    """A command running on an SSH channel; `finish` sends the rest of stdin and collects."""

    def __init__(self, conn: "SSHConnection", argv: list[str], chan: paramiko.Channel, hold_stdin: bool = False):
        self.conn, self.argv, self.chan, self.hold_stdin = conn, argv, chan, hold_stdin

    def finish(self, input=None, *, check=True, timeout=None, stream=None):
        timeout = timeout if timeout is not None else self.conn.timeouts.command
        try:
            res = _pump_channel(self.chan, input, stream, timeout, self.conn.name, self.hold_stdin)
        except (SSHException, OSError, EOFError) as exc:
            raise self.conn.lost(self.argv, exc) from None
        finally:  # the remote command sees end of file (when held: the client is done or gone)
            self.chan.close()
        return check_result(self.conn.name, self.argv, res, check)


# The command runs as a child of a POSIX sh that names the signal that killed it (sshd's
# `exit-signal` is dropped by paramiko): a status above 128 ends stderr with the marker and the
# signal's name. A command that itself exits 128+N reads the same (no shell can tell them apart).
# The sh's own stderr is /dev/null (dash reports "Killed" there); the command keeps the real one.
KILLED_MARK = "\x1eddeploy-exit-signal:"
WRAPPER = (
    'exec 3>&2 2>/dev/null; (exec 2>&3 3>&-; exec "$@"); s=$?; [ $s -gt 128 ] && n=$(kill -l $s)'
    ' && printf "\\036ddeploy-exit-signal:%s" "$n" >&3; exit $s'
)


def remote_line(words: list[str], cwd: str | None) -> str:
    """The line the login shell runs: `sh -c WRAPPER sh WORDS...`, after `cd CWD &&`; all quoted."""
    line = quote_argv(["sh", "-c", WRAPPER, "sh", *words])
    return f"cd {shlex.quote(str(cwd))} && {line}" if cwd else line


def split_killed_mark(err: bytes, rc: int) -> tuple[bytes, str | None]:
    """stderr without the wrapper's marker, and the signal it names (None: not killed)."""
    head, mark, name = err.rpartition(KILLED_MARK.encode())
    if not mark or rc <= 128 or not name.isalnum():
        return err, None
    return head, name.decode()


def _pump_channel(
    chan: paramiko.Channel,
    input: bytes | None,
    stream: Stream | None,
    timeout: float | None,
    host: str,
    hold_stdin: bool = False,
) -> RunResult:
    if input:
        chan.sendall(input)
    if not hold_stdin:
        chan.shutdown_write()
    out, err = bytearray(), bytearray()
    splitter = LineSplitter(stream)
    deadline = time.monotonic() + timeout if timeout else None
    chan.settimeout(0.2)
    while True:
        got = False
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            err += data
            splitter.feed(data)
            got = True
        try:
            data = chan.recv(65536)
            if data:
                out += data
                got = True
            elif chan.exit_status_ready() and not chan.recv_stderr_ready():
                break
        except socket.timeout:
            pass
        if not got and chan.closed and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if deadline and time.monotonic() > deadline:
            chan.close()
            raise RemoteCommandError(f"command timed out after {timeout:g}s", host=host)
        transport = chan.get_transport()
        if transport is None or not transport.is_active():
            raise EOFError("the SSH transport closed")
    rc = chan.recv_exit_status()
    if rc == -1 and not (chan.eof_received and chan.get_transport().is_active()):
        raise EOFError("no exit status (connection cut)")
    err, killed = split_killed_mark(bytes(err), rc)
    splitter.flush(drop=KILLED_MARK.encode() + killed.encode() if killed else b"")
    if rc == -1:  # the wrapper itself was killed: sshd named the signal, which paramiko drops
        killed, rc = UNKNOWN_SIGNAL, signal_rc(UNKNOWN_SIGNAL)
    return RunResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), killed)
