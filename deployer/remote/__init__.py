"""Talk to the host-side agent (deployer/remote/agent.py): one JSON request in, one JSON result out.

The agent is stdlib-only and runs with the host's inventory `python` as `python -c <source> OP`, so
nothing has to be installed on a host and client and agent can never be out of step.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

from .. import errors
from ..connection import Connection, last_line
from ..inventory import Host

AGENT_PATH = Path(__file__).with_name("agent.py")
MAX_SOURCE = 100_000  # one argv word may be at most 128 KiB on Linux


@functools.cache  # read once per process, not once per agent call on every host
def agent_source() -> str:
    src = AGENT_PATH.read_text()
    assert len(src) < MAX_SOURCE, "agent.py grew past what fits in one argv word"
    return src


def error_for(kind: str, message: str, host: str) -> errors.DeployError:
    """The agent names a deployer.errors class; unknown names become RemoteCommandError."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DeployError)):
        cls = errors.RemoteCommandError
    return cls(message, host=host)


class AgentReply(dict):
    """The agent's result; a missing field (a foreign or broken agent) is one clear error, not a KeyError."""

    def __init__(self, data: dict[str, Any], host: Host):
        super().__init__(data)
        self._host = host

    def __missing__(self, key: str) -> Any:
        raise errors.RemoteCommandError(f"the ddeploy agent ({self._host.python}) replied without {key!r}; "
                                        f"check `python` in the inventory", host=self._host.name)


def _parse_reply(line: str, host: Host) -> dict[str, Any]:
    """The agent's last JSON line; anything else (a hostile or broken python) is one clear error."""
    try:
        result = json.loads(line)
    except ValueError:
        result = None
    if not isinstance(result, dict):
        raise errors.RemoteCommandError(f"the ddeploy agent ({host.python}) replied with something that is not a "
                                        f"JSON object: {line[:80]!r}; check `python` in the inventory", host=host.name)
    return AgentReply(result, host)


def call_agent(conn: Connection, host: Host, op: str, request: dict[str, Any], *,
               stream: Callable[[str], None] | None = None, timeout: float | None = None,
               passthrough: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one agent operation on the host; returns its result or raises the error it reported
    (error kinds in `passthrough` come back as the result instead)."""
    req = {"op": op, "checkout": host.checkout, **request}
    res = conn.run([host.python, "-c", agent_source(), op], input=json.dumps(req).encode(), check=False,
                   stream=stream, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.rc != 0 or not lines:
        raise errors.RemoteCommandError(f"the ddeploy agent ({host.python}) failed with exit {res.rc}: "
                                        f"{last_line(res.stderr)}; "
                                        f"check `python` in the inventory (Python >= 3.8 needed)", host=host.name)
    result = _parse_reply(lines[-1], host)
    if not result.get("ok"):
        err = result.get("error") if isinstance(result.get("error"), dict) else {}
        if err.get("kind") in passthrough:
            return result
        raise error_for(str(err.get("kind")), str(err.get("message", "unknown agent error")), host.name)
    return result
