"""What every connection offers: argv commands, their results, and commands started early.

    res = conn.run(["git", "rev-parse", "HEAD"], check=False)   # RunResult(rc, stdout, stderr, signal)
    started = conn.start(argv, first_input=program)            # the rest of stdin comes with finish()
    res = started.finish(request)

Commands are argv lists; `quote_argv` is the one place a line for a remote shell is built.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..agent.common import last_text_line
from ..errors import RemoteCommandError

if TYPE_CHECKING:
    from ..inventory import Host

Stream = Callable[[str], None]
UNKNOWN_SIGNAL = "?"  # the process died of a signal its host did not name


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
    if name == UNKNOWN_SIGNAL:
        return "a signal"
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


def env_prefix(env: dict[str, str] | None) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def check_result(host: str, argv: list[str], res: RunResult, check: bool) -> RunResult:
    """res, or (with check) the RemoteCommandError for a command that failed or was killed."""
    what = f"`{argv[0]} {' '.join(argv[1:3])}...`"
    if check and res.signal:
        raise RemoteCommandError(f"{what} was killed by {killed_by(res.signal)}", host=host)
    if check and res.rc != 0:
        last = last_text_line(res.stderr, res.stdout)
        raise RemoteCommandError(f"{what} exited {res.rc}: {last}", host=host)
    return res


class LineSplitter:
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

    def flush(self, drop: bytes = b"") -> None:
        """Stream the last, unterminated line, without `drop` at its end."""
        self.buf = self.buf.removesuffix(drop) if drop else self.buf
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
    """Common interface; see LocalConnection (local.py) and SSHConnection (ssh_connection.py)."""

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
