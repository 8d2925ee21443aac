"""Talk to the host-side agent (deployer/transport/agent.py): one JSON request in, one JSON reply out.

The agent is stdlib-only and runs with the host's inventory `python` as `python -S - OP` (-S: no
site-packages, whose .pth hooks can cost more than the agent's work): its source, as a bytes
literal in a small boot program, and the call with the request come on stdin, so nothing has to
be installed on a host, client and agent can never be out of step, and neither the source nor
the request shows in `ps` on the host. The boot program keeps the agent's bytecode in
~/.cache/ddeploy/agent/ on the host (one file per agent source and Python, like __pycache__), so
a call does not compile its 1,600 lines again. Every reply is validated into its model from
deployer/transport/protocol.py.

    with agent_session(host, accept_new_host_keys=False) as agent:   # one SSH connection
        status = agent.call("status", {}, StatusReply, stream=say)
"""

from __future__ import annotations

import functools
import getpass
import json
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from .. import errors
from ..inventory import Host
from .connection import Connection, killed_by, last_line, open_connection

AGENT_PATH = Path(__file__).with_name("agent.py")
R = TypeVar("R")


# Python >= 3.8 and the standard library, like the agent. The cache file's name is a hash of the
# source and the interpreter, so a changed agent or another Python never loads stale bytecode.
BOOT = b"""import hashlib, marshal, os, sys


def _agent_code(src):
    tag = "%s %s %d" % (sys.version, sys.implementation.cache_tag, sys.flags.optimize)
    key = hashlib.sha256(src + tag.encode()).hexdigest()[:40]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddeploy", "agent")
    path = os.path.join(cache, key + ".marshal")
    try:
        with open(path, "rb") as fh:
            return marshal.loads(fh.read())
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = compile(src, "ddeploy-agent", "exec")
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "wb") as fh:
            fh.write(marshal.dumps(code))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable home only costs the compile
    return code


"""


@functools.cache  # read once per process, not once per agent call on every host
def agent_source() -> bytes:
    return AGENT_PATH.read_bytes()


@functools.cache
def _boot_program() -> bytes:
    return BOOT + b"exec(_agent_code(%s))\n" % repr(agent_source()).encode()


def agent_program(request: dict[str, Any]) -> bytes:
    """What `python -` reads: the boot program with the agent's source, then the call with the
    request (a Python string literal)."""
    return _boot_program() + b"sys.exit(main(sys.argv, %s))\n" % repr(json.dumps(request)).encode()


def who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def error_for(kind: str, message: str, host: str) -> errors.DeployError:
    """The agent names a deployer.errors class; unknown names become RemoteCommandError."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DeployError)):
        cls = errors.RemoteCommandError
    return cls(message, host=host)


def _reply_problem(exc: Exception) -> str:
    """What is wrong with a reply that does not fit its model, in a few words."""
    first = exc.errors()[0]  # type: ignore[attr-defined]
    field = ".".join(str(x) for x in first["loc"])
    if first["type"] == "missing":
        return f"replied without {field!r}"
    return f"replied with a bad {field!r} ({first['msg']})"


class AgentSession:
    """Agent calls over one open connection (each call a channel on it: no new SSH handshake)."""

    def __init__(self, conn: Connection, host: Host, command: str = "ddeploy"):
        self.conn, self.host, self.command = conn, host, command

    def _fail(self, what: str) -> errors.RemoteCommandError:
        return errors.RemoteCommandError(
            f"the ddeploy agent ({self.host.python}) {what}; check `python` in the inventory", host=self.host.name
        )

    def _raw(self, op: str, request: dict[str, Any], stream, timeout) -> dict[str, Any]:
        req = {"op": op, "checkout": self.host.checkout, "by": who(), "command": self.command, **request}
        res = self.conn.run(
            [self.host.python, "-S", "-", op], input=agent_program(req), check=False, stream=stream, timeout=timeout
        )
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.signal:  # not a cut connection: the host is up, the agent is gone
            raise errors.RemoteCommandError(
                f"the agent process on {self.host.name} died (killed by {killed_by(res.signal)}) during `{op}`; "
                f"`ddeploy status --host {self.host.name}` shows what it left",
                host=self.host.name,
            )
        if res.rc != 0 or not lines:
            raise self._fail(f"failed with exit {res.rc}: {last_line(res.stderr)} (Python >= 3.8 needed)")
        try:
            reply = json.loads(lines[-1])
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise self._fail(f"replied with something that is not a JSON object: {lines[-1][:80]!r}")
        return reply

    def call(
        self,
        op: str,
        request: dict[str, Any],
        model: type[R],
        *,
        stream: Callable[[str], None] | None = None,
        timeout: float | None = None,
        passthrough: tuple[str, ...] = (),
    ) -> R:
        """Run one agent operation; its reply as `model`, or the error it reported raised as a
        DeployError (error kinds in `passthrough` come back as a failed protocol.Reply instead)."""
        from pydantic import ValidationError

        from .protocol import Reply

        reply = self._raw(op, request, stream, timeout)
        if not reply.get("ok"):
            err = reply.get("error") if isinstance(reply.get("error"), dict) else {}
            if err.get("kind") in passthrough:
                return Reply.model_validate(reply)  # type: ignore[return-value]
            raise error_for(str(err.get("kind")), str(err.get("message", "unknown agent error")), self.host.name)
        try:
            return model.model_validate(reply)  # type: ignore[attr-defined]
        except ValidationError as exc:
            raise self._fail(_reply_problem(exc)) from None


@contextmanager
def agent_session(
    host: Host, *, accept_new_host_keys: bool = False, command: str = "ddeploy"
) -> Iterator[AgentSession]:
    """One connection to the host for every agent call of a command (raises ConnectError)."""
    with open_connection(host, accept_new_host_keys=accept_new_host_keys) as conn:
        yield AgentSession(conn, host, command)
