"""Connections to hosts: one interface for this machine (subprocess) and SSH hosts (Fabric).

    with open_connection(host) as conn:
        res = conn.run(["git", "-C", host.checkout, "rev-parse", "HEAD"])   # RunResult(rc, stdout, stderr)

Commands are argv lists, quoted with shlex before they reach the remote shell. Host keys are
checked strictly on every hop against known_hosts (deployer/transport/ssh.py);
`accept_new_host_keys=True` records an unknown key there, a changed key is always refused. A
refused or timed-out connect is tried again (with_retries); failures raise ConnectError with one
line naming the host.
"""

from __future__ import annotations

import logging
import os
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

import paramiko
from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, NoValidConnectionsError, SSHException

from ..agent.common import last_text_line
from ..errors import ConnectError, RemoteCommandError

if TYPE_CHECKING:
    from ..inventory import Host

Stream = Callable[[str], None]
T = TypeVar("T")
# paramiko's transport thread logs its own tracebacks (e.g. a banner timeout) through the root
# logger's last-resort handler; every failure already becomes one ConnectError line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0  # TCP connect
    banner: float = 10.0  # SSH banner after TCP connect
    auth: float = 15.0
    command: float | None = None  # default per-command limit (None: no limit)
    keepalive: int = 15  # seconds between keepalives; a dead peer is noticed
    retries: int = 3  # connects tried again after a refusal or a timeout (a host rebooting)
    backoff: float = 1.0  # seconds before the first retry; doubled before each next one

    @classmethod
    def from_env(cls) -> "Timeouts":
        """Defaults, overridden by DDEPLOY_{CONNECT,BANNER,AUTH,COMMAND}_TIMEOUT (seconds),
        DDEPLOY_CONNECT_RETRIES (a count) and DDEPLOY_CONNECT_BACKOFF (seconds)."""
        values: dict = _retry_settings()
        for name in ("connect", "banner", "auth", "command"):
            raw = os.environ.get(f"DDEPLOY_{name.upper()}_TIMEOUT")
            if raw:
                try:
                    values[name] = float(raw)
                except ValueError:
                    values[name] = float("nan")
                if not 0 < values[name] < 1e9:  # also refuses nan and inf
                    raise ConnectError(
                        f"DDEPLOY_{name.upper()}_TIMEOUT={raw!r} is not a number of seconds "
                        f"(must be positive and finite)"
                    )
        return cls(**values)


def _retry_settings() -> dict:
    values: dict = {}
    for name, key, kind in (("retries", "DDEPLOY_CONNECT_RETRIES", int), ("backoff", "DDEPLOY_CONNECT_BACKOFF", float)):
        raw = os.environ.get(key)
        if not raw:
            continue
        try:
            values[name] = kind(raw)
        except ValueError:
            values[name] = -1
        if not 0 <= values[name] < 1000:
            raise ConnectError(f"{key}={raw!r} is not a {kind.__name__} between 0 and 1000")
    return values


def is_transient(exc: BaseException) -> bool:
    """A connect that may work a moment later: refused (sshd not up yet, directly or through a
    jump host) or timed out. Never an authentication or host-key failure."""
    if isinstance(exc, (AuthenticationException, BadHostKeyException)):
        return False
    if isinstance(exc, paramiko.ChannelException):  # a jump host could not reach the next hop
        return True
    return isinstance(exc, (NoValidConnectionsError, ConnectionRefusedError, socket.timeout, TimeoutError))


def with_retries(connect: Callable[[], T], timeouts: Timeouts) -> tuple[T, int]:
    """connect(), tried again after a transient failure (is_transient) up to timeouts.retries
    times, waiting backoff, 2x backoff, ...; the result and the number of attempts. Raises the
    last failure with `attempts` set on it."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return connect(), attempt
        except Exception as exc:
            if attempt > timeouts.retries or not is_transient(exc):
                exc.attempts = attempt  # type: ignore[attr-defined]
                raise
        time.sleep(timeouts.backoff * 2 ** (attempt - 1))


@dataclass(frozen=True)
class RunResult:
    rc: int
    stdout: str
    stderr: str
    signal: str | None = None  # "KILL", ...: the process was killed by this signal (rc is then 128 + its number)

    @property
    def ok(self) -> bool:
        return self.rc == 0


def killed_by(name: str) -> str:
    """`SIGKILL` for "KILL" (the SSH exit-signal name) or "SIGKILL" (Python's)."""
    return name if name.startswith("SIG") else f"SIG{name}"


def signal_rc(name: str) -> int:
    """A shell's exit code for a process killed by this signal (128 + its number; 255 if unknown)."""
    number = getattr(signal, killed_by(name), None)
    return 128 + int(number) if number is not None else 255


def quote_argv(argv: list[str]) -> str:
    """The one place a command line is built for a remote shell: every word shlex-quoted."""
    if not argv:
        raise ValueError("empty command")
    return " ".join(shlex.quote(str(a)) for a in argv)


def _env_prefix(env: dict[str, str] | None) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def _check(host: str, argv: list[str], res: RunResult, check: bool) -> RunResult:
    what = f"`{argv[0]} {' '.join(argv[1:3])}...`"
    if check and res.signal:
        raise RemoteCommandError(f"{what} was killed by {killed_by(res.signal)}", host=host)
    if check and res.rc != 0:
        last = last_text_line(res.stderr, res.stdout)
        raise RemoteCommandError(f"{what} exited {res.rc}: {last}", host=host)
    return res


class _LineSplitter:
    """Feed bytes, call `stream` once per complete line (the rest waits for more)."""

    def __init__(self, stream: Stream | None):
        self.stream, self.buf = stream, b""

    def feed(self, data: bytes) -> None:
        if not self.stream:
            return
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self.stream(line.decode(errors="replace"))

    def flush(self) -> None:
        if self.stream and self.buf:
            self.stream(self.buf.decode(errors="replace"))
        self.buf = b""


class StartedCommand:
    """A command started before all of its input is known: `first_input` went with the start,
    the rest goes with `finish`, which waits for the result. This one (the base and local
    behaviour) simply runs the whole command at `finish`. `hold_stdin`: the command's stdin stays
    open until it ends, so end of file there tells it the client has gone (Ctrl-C, a cut link)."""

    def __init__(
        self,
        conn: "Connection",
        argv: list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        first: bytes,
        hold_stdin: bool = False,
    ):
        self.conn, self.argv, self.cwd, self.env, self.first_input = conn, argv, cwd, env, first
        self.hold_stdin = hold_stdin

    def finish(
        self,
        input: bytes | None = None,
        *,
        check: bool = True,
        timeout: float | None = None,
        stream: Stream | None = None,
    ) -> RunResult:
        data = self.first_input + (input or b"")
        return self.conn.run(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            check=check,
            timeout=timeout,
            stream=stream,
            input=data,
            hold_stdin=self.hold_stdin,
        )


class Connection:
    """Common interface; see LocalConnection and SSHConnection."""

    host: Host

    @property
    def name(self) -> str:
        return self.host.name

    def run(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
        timeout: float | None = None,
        stream: Stream | None = None,
        input: bytes | None = None,
        hold_stdin: bool = False,
    ) -> RunResult:
        """Run argv with `input` on its stdin; `hold_stdin`: keep stdin open until it ends."""
        raise NotImplementedError

    def start(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        first_input: bytes = b"",
        hold_stdin: bool = False,
    ) -> StartedCommand:
        """Start argv now with the first part of its stdin; `.finish(rest)` for the result."""
        return StartedCommand(self, argv, cwd, env, first_input, hold_stdin)

    def close(self) -> None:
        pass

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalConnection(Connection):
    """This machine: commands run as subprocesses (argv, no shell)."""

    def __init__(self, host: Host, timeouts: Timeouts = Timeouts()):
        self.host, self.timeouts = host, timeouts

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
            return _check(self.name, argv, RunResult(127, "", f"{argv[0]}: {exc.strerror}"), check)
        try:
            out, err = _pump_local(proc, input, stream, timeout, self.name, hold_stdin)
        finally:  # the command sees end of file now (when held: the client is done or gone)
            _close_quietly(proc.stdin)
        if proc.returncode < 0:  # killed by a signal, as an SSH host reports with exit-signal
            name = signal.Signals(-proc.returncode).name
            return _check(self.name, argv, RunResult(signal_rc(name), out, err, signal=name[3:]), check)
        return _check(self.name, argv, RunResult(proc.returncode, out, err), check)


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
    splitter = _LineSplitter(stream)
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


class SSHConnection(Connection):
    """An SSH host: a fabric.Connection (deployer/transport/ssh.py: ssh_config, ProxyJump hops,
    strict host keys on every hop)."""

    def __init__(self, host: Host, *, accept_new_host_keys: bool = False, timeouts: Timeouts = Timeouts()):
        from . import ssh

        self.host, self.timeouts = host, timeouts
        if host.ssh.identity and not Path(host.ssh.identity).expanduser().is_file():
            raise ConnectError(
                f"identity file {Path(host.ssh.identity).expanduser()} (ssh.identity in {host.source}) does not "
                f"exist; fix the path or create the key",
                host=host.name,
            )
        self.config = ssh.ssh_config_for(host, timeouts)
        self.fabric = self._chain(accept_new_host_keys)  # the target: user, host, port, gateway
        try:
            self.fabric, _ = with_retries(lambda: self._open_fresh(accept_new_host_keys), timeouts)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line
            where = getattr(exc, "hop", None) or ssh.target(self.fabric)
            message = describe_connect_error(exc, where) + _attempts(exc)
            raise ConnectError(message, host=self.name) from None
        self.transport = self.fabric.transport
        self.transport.set_keepalive(self.timeouts.keepalive)
        _keep_exit_signals(self.transport)

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
        words = [*_env_prefix({**self.host.env, **(env or {})}), *argv]
        line = quote_argv(words)
        if cwd:
            line = f"cd {shlex.quote(str(cwd))} && {line}"
        # A raw paramiko channel, not Fabric's run(): the agent protocol sends stdin in two parts
        # (the program at start, the request later), streams stderr lines as progress while it
        # runs, and tells a killed process (exit-signal) from a cut connection.
        try:
            chan = self.transport.open_session()
            chan.exec_command(line)
            if first_input:
                chan.sendall(first_input)
        except (SSHException, OSError, EOFError) as exc:
            raise _lost(self.name, argv, exc) from None
        return _StartedChannel(self, argv, chan, hold_stdin)

    def close(self) -> None:
        from . import ssh

        if getattr(self, "transport", None) is not None:
            ssh.close_chain(self.fabric)


def _lost(host: str, argv: list[str], exc: BaseException) -> ConnectError:
    return ConnectError(f"connection lost while running {argv[0]}: {exc or type(exc).__name__}", host=host)


class _StartedChannel(StartedCommand):
    """A command running on an SSH channel; `finish` sends the rest of stdin and collects."""

    def __init__(self, conn: "SSHConnection", argv: list[str], chan: paramiko.Channel, hold_stdin: bool = False):
        self.conn, self.argv, self.chan, self.hold_stdin = conn, argv, chan, hold_stdin

    def finish(self, input=None, *, check=True, timeout=None, stream=None):
        timeout = timeout if timeout is not None else self.conn.timeouts.command
        try:
            res = _pump_channel(self.chan, input, stream, timeout, self.conn.name, self.hold_stdin)
        except (SSHException, OSError, EOFError) as exc:
            raise _lost(self.conn.name, self.argv, exc) from None
        finally:  # the remote command sees end of file (when held: the client is done or gone)
            self.chan.close()
        return _check(self.conn.name, self.argv, res, check)


def _keep_exit_signals(transport: paramiko.Transport) -> None:
    """paramiko ignores a channel's `exit-signal` (RFC 4254 6.10: the remote process was killed);
    record its name on the channel so that is not mistaken for a cut connection."""
    table = dict(transport._channel_handler_table)
    table[paramiko.common.MSG_CHANNEL_REQUEST] = _channel_request
    transport._channel_handler_table = table  # this transport only (its reader thread looks it up per message)


def _channel_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: always false for exit-signal
        chan.exit_signal = m.get_text()  # "KILL", "SEGV", ...: the name without "SIG"
        return
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


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
    splitter = _LineSplitter(stream)
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
    splitter.flush()
    rc = chan.recv_exit_status()
    killed = getattr(chan, "exit_signal", None)
    if rc == -1 and killed:  # the process died of a signal; the connection is fine
        return RunResult(signal_rc(killed), out.decode(errors="replace"), err.decode(errors="replace"), killed)
    if rc == -1:  # the channel closed without an exit status: the connection went away
        raise EOFError("no exit status (connection cut)")
    return RunResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))


def _attempts(exc: BaseException) -> str:
    n = getattr(exc, "attempts", 1)
    return f" (tried {n} times)" if n > 1 else ""


def describe_connect_error(exc: BaseException, target: str) -> str:
    """One line for a failed connect: what happened and what to do next."""
    msg = str(exc)
    if isinstance(exc, BadHostKeyException):
        return (
            f"host key for {target} has CHANGED (possible man-in-the-middle); refusing to connect. "
            f"If the host was reinstalled, verify the new key and remove the old one from known_hosts"
        )
    if isinstance(exc, SSHException) and "not found in known_hosts" in msg:
        return (
            f"host key for {target} is unknown (not in known_hosts); verify it and rerun with "
            f"--accept-new-host-keys to record it"
        )
    if isinstance(exc, AuthenticationException):
        return f"authentication refused by {target} ({msg or 'no accepted key'}); check user and identity file"
    if isinstance(exc, NoValidConnectionsError):
        return f"{target} is unreachable (connection refused); is sshd running and the address right?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {target} ({exc.strerror}); check the address in the inventory or ssh_config"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out connecting to {target}; check the network/firewall"
    if isinstance(exc, SSHException) and ("banner" in msg.lower() or "No existing session" in msg):
        return f"{target} accepted TCP but sent no SSH banner (banner timeout); is it an SSH server?"
    if isinstance(exc, OSError):
        return f"cannot connect to {target}: {exc.strerror or exc}"
    return f"cannot connect to {target}: {type(exc).__name__}: {msg.splitlines()[0] if msg else ''}"


def open_connection(host: Host, *, accept_new_host_keys: bool = False, timeouts: Timeouts | None = None) -> Connection:
    """Connect to a host (raises ConnectError); use as a context manager to close it.

    Timeouts default to the DDEPLOY_*_TIMEOUT settings, so every command honours them."""
    timeouts = timeouts or Timeouts.from_env()
    if host.is_local:
        return LocalConnection(host, timeouts)
    return SSHConnection(host, accept_new_host_keys=accept_new_host_keys, timeouts=timeouts)
