"""Talk to the host-side agent (deployer/agent/): one JSON request in, one JSON reply out.

The agent is stdlib-only and runs with the host's inventory `python` as `python -S -c BOOTSTRAP
OP DIGEST` (-S: no site-packages, whose .pth hooks can cost more than the agent's work). DIGEST is
the sha256 of the agent's bundle ({module: source} as JSON, a readable package here; both, and the
argv and stdin, come from agent_bundle.py). The host
keeps the bundle compiled under DIGEST (~/.cache/ddeploy/agent/), so its ~100 KB cross once per
host and agent version: the first call sends it on stdin and the host says that it kept it; later
calls send only the request (a host without an intact copy answers NeedAgent, and gets it). So
nothing has to be installed on a host by hand, client and agent can never be out of step, neither
the source nor the request shows in `ps` on the host, and the agent can start before the request
exists: an EarlyAgents (early_agents.py) opens the connections and starts the agents while the
client still prepares the request (the SSH handshake, the host's login shell and Python's start-up then overlap
with the client's own work). Every reply is validated into its model from
deployer/transport/protocol.py.

    with agent_session(host, accept_new_host_keys=False) as agent:   # one SSH connection
        status = agent.call("status", {}, StatusReply, stream=say)
"""

from __future__ import annotations

import getpass
import hashlib
import json
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, TypeVar

from .. import errors
from ..agent.common import last_text_line
from .agent_bundle import (  # noqa: F401 - the bundle's names, for callers of this module
    AGENT_PACKAGE,
    BOOTSTRAP,
    HOST_PACKAGE,
    agent_argv,
    agent_bundle,
    agent_digest,
    agent_sources,
    agent_stdin,
    bundle_digest,
    bundle_of,
)
from .command import Connection, StartedCommand, killed_by
from .connection import open_connection
from .wire import error_for

if TYPE_CHECKING:
    from ..inventory import Host

R = TypeVar("R")


def kept_marker(host: Host) -> Path:
    """Where this client notes that `host` keeps the current agent (a hint, never trusted: a host
    without an intact copy answers NeedAgent and gets the bundle)."""
    from ..locations import cache_dir

    address = f"{host.ssh.host}:{host.ssh.port}" if host.ssh else host.connection
    key = hashlib.sha256(f"{host.name}\0{address}\0{host.python}".encode()).hexdigest()[:16]
    return cache_dir() / "agents" / key / agent_digest()


def _needs_agent(reply: dict[str, Any]) -> bool:
    """The host keeps no intact copy of the agent that was named, and ran nothing."""
    err = reply.get("error")
    return isinstance(err, dict) and err.get("kind") == "NeedAgent"


def _note(marker: Path) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # a read-only cache costs sending the bundle each time, nothing else


def _forget(marker: Path) -> None:
    try:
        marker.unlink()
    except OSError:
        pass


def who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _reply_problem(exc: Exception) -> str:
    """What is wrong with a reply that does not fit its model, in a few words."""
    first = exc.errors()[0]  # type: ignore[attr-defined]
    field = ".".join(str(x) for x in first["loc"])
    if first["type"] == "missing":
        return f"replied without {field!r}"
    return f"replied with a bad {field!r} ({first['msg']})"


class EarlySessions(Protocol):
    """Sessions opened before the command asked for them (early_agents.EarlyAgents)."""

    def take(self, host: Host) -> AgentSession | None: ...


class AgentSession:
    """Agent calls over one open connection (each call a channel on it: no new SSH handshake)."""

    def __init__(self, conn: Connection, host: Host, command: str = "ddeploy"):
        self.conn, self.host, self.command = conn, host, command
        self._started: dict[str, tuple[StartedCommand, bool]] = {}

    def _fail(self, what: str) -> errors.RemoteCommandError:
        return errors.RemoteCommandError(
            f"the ddeploy agent ({self.host.python}) {what}; check `python` in the inventory", host=self.host.name
        )

    def _start(self, op: str, send: bool | None = None) -> tuple[StartedCommand, bool]:
        """The agent for `op`, started with its bundle unless this client delivered it to the
        host before (`send`: whether it did send it)."""
        send = not kept_marker(self.host).exists() if send is None else send
        argv, stdin = agent_argv(self.host.python, op), agent_stdin(send=send)
        # stdin stays open after the request: its end tells the agent this client has gone.
        return self.conn.start(argv, first_input=stdin, hold_stdin=True), send

    def start(self, op: str) -> None:
        """Start the agent for the next `op` call now; the call then only sends its request."""
        self._started[op] = self._start(op)

    def _raw(self, op: str, request: dict[str, Any], stream, timeout) -> dict[str, Any]:
        req = {"op": op, "checkout": self.host.checkout, "by": who(), "command": self.command, **request}
        started, sent = self._started.pop(op, None) or self._start(op)
        reply, kept = self._finish(op, started, req, stream, timeout)
        if not sent and _needs_agent(reply):
            _forget(kept_marker(self.host))  # the host lost it (or never kept it): send it this once
            started, sent = self._start(op, send=True)
            reply, kept = self._finish(op, started, req, stream, timeout)
        if sent and kept:
            _note(kept_marker(self.host))
        return reply

    def _finish(self, op: str, started: StartedCommand, req: dict, stream, timeout) -> tuple[dict[str, Any], bool]:
        """The agent's reply, and whether it said that the host keeps its bundle."""
        res = started.finish(json.dumps(req).encode() + b"\n", check=False, stream=stream, timeout=timeout)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.signal:  # not a cut connection: the host is up, the agent is gone
            raise errors.RemoteCommandError(
                f"the agent process on {self.host.name} died (killed by {killed_by(res.signal)}) during `{op}`; "
                f"`ddeploy status --host {self.host.name}` shows what it left",
                host=self.host.name,
            )
        if res.rc != 0 or not lines:
            raise self._fail(f"failed with exit {res.rc}: {last_text_line(res.stderr)} (Python >= 3.8 needed)")
        try:
            reply = json.loads(lines[-1])
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise self._fail(f"replied with something that is not a JSON object: {lines[-1][:80]!r}")
        return reply, f"ddeploy-agent kept {agent_digest()}" in res.stdout.splitlines()

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
    host: Host, *, accept_new_host_keys: bool = False, command: str = "ddeploy", early: EarlySessions | None = None
) -> Iterator[AgentSession]:
    """One connection to the host for every agent call of a command (raises ConnectError); the
    early one when `early` opened it."""
    session = early.take(host) if early is not None else None
    if session is None:
        session = AgentSession(open_connection(host, accept_new_host_keys=accept_new_host_keys), host, command)
    with session.conn:
        yield session
