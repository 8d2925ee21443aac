"""The agent as it travels: its bundle ({module: source} of deployer/agent/ as one JSON object,
Ansible's AnsiballZ payload without the zip), the bundle's sha256 (its name on a host), and the
bootstrap program that `python -S -c` runs on the host (agent_client.py: the session that uses
them). Standard library only.

    argv = agent_argv(host.python, "status")    # [python, -S, -c, BOOTSTRAP, OP, DIGEST]
    stdin = agent_stdin(request, send=False)    # the host keeps the bundle: only "0" and the request
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

AGENT_PACKAGE = Path(__file__).resolve().parent.parent / "agent"  # deployer/agent/, stdlib only
HOST_PACKAGE = "ddeploy_agent"  # its name on the host


# What `python -S -c` runs on the host, with argv OP DIGEST (the sha256 of the bundle). Python
# >= 3.8 and the standard library, like the agent. stdin: the bundle's length, the bundle (none:
# the client expects the host to keep it), then the request (one line, read by the agent). The
# host keeps the bundle compiled under its hash, one file per bundle and Python (like
# __pycache__), checksummed: a cut-off or altered file, or one kept for another bundle, is never
# run. When it has no intact copy and none was sent, the agent answers NeedAgent and the client
# sends the bundle. deployer/agent/boot.py, from the bundle, compiles and keeps it, imports the
# agent and runs it.
BOOTSTRAP = (
    """import os, sys
from hashlib import sha256

DIGEST = sys.argv[2]
PACKAGE = "%s"
stdin = sys.stdin.buffer


def kept_path():
    tag = "%%s %%s %%d" %% (sys.version, sys.implementation.cache_tag, sys.flags.optimize)
    name = "%%s-%%s.marshal" %% (DIGEST, sha256(tag.encode()).hexdigest()[:12])
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(home, "ddeploy", "agent", name)


def kept(path):
    from marshal import loads

    try:
        with open(path, "rb") as fh:
            data = fh.read()
        if sha256(data[32:]).digest() == data[:32]:
            named, codes = loads(data[32:])
            if named == DIGEST:
                return codes
    except (OSError, ValueError, EOFError, TypeError):
        pass
    return None


def refuse(kind, message):
    stdin.readline()  # the request: read, not run
    sys.stdout.write('{"ok": false, "error": {"kind": "%%s", "message": "%%s"}}\\n' %% (kind, message))
    sys.exit(0)


path = kept_path()
codes = kept(path)
head = stdin.readline()
if not head:  # closed before a request came: an agent started early (early_agents.py), not needed
    sys.exit(0)
bundle = stdin.read(int(head))
if bundle and sha256(bundle).hexdigest() != DIGEST:
    refuse("RemoteCommandError", "the agent arrived damaged (sha256 mismatch); run the command again")
if codes is None and not bundle:
    refuse("NeedAgent", "this host keeps no agent %%s" %% DIGEST[:12])
boot = {"__name__": PACKAGE + ".boot"}
if codes is None:  # compiled from the bundle sent, and kept
    import json

    sources = json.loads(bundle.decode())
    exec(compile(sources[PACKAGE + ".boot"], "<ddeploy-agent>/boot.py", "exec"), boot)
    codes = boot["keep"](path, DIGEST, sources)
else:
    exec(codes[PACKAGE + ".boot"], boot)
    if bundle:
        sys.stdout.write("ddeploy-agent kept %%s\\n" %% DIGEST)
boot["run"](codes)
"""
    % HOST_PACKAGE
)


@functools.cache  # read once per process, not once per agent call on every host
def agent_sources() -> dict[str, bytes]:
    """{module name on the host: source} for every module of deployer/agent/."""
    sources = {}
    for path in sorted(AGENT_PACKAGE.glob("*.py")):
        if path.name != "__main__.py":
            name = HOST_PACKAGE if path.stem == "__init__" else f"{HOST_PACKAGE}.{path.stem}"
            sources[name] = path.read_bytes()
    return sources


def bundle_of(sources: dict[str, bytes]) -> bytes:
    """The bundle as it travels: one JSON object {module name: source} (Ansible's AnsiballZ
    payload, without the zip)."""
    return json.dumps({name: src.decode() for name, src in sources.items()}, sort_keys=True).encode()


def bundle_digest(sources: dict[str, bytes]) -> str:
    return hashlib.sha256(bundle_of(sources)).hexdigest()


@functools.cache
def agent_bundle() -> bytes:
    return bundle_of(agent_sources())


@functools.cache
def agent_digest() -> str:
    """The agent's name on a host: the sha256 of its bundle."""
    return hashlib.sha256(agent_bundle()).hexdigest()


def agent_argv(python: str, op: str) -> list[str]:
    return [python, "-S", "-c", BOOTSTRAP, op, agent_digest()]


@functools.cache  # the same ~100 KB for every call that sends it: built once
def _bundle_head() -> bytes:
    return b"%d\n" % len(agent_bundle()) + agent_bundle()


def agent_stdin(request: dict[str, Any] | None = None, *, send: bool = True) -> bytes:
    """What the agent reads on stdin: the bundle (length-prefixed; `send=False`: none, the host
    keeps it), then the request (one line), if known."""
    head = _bundle_head() if send else b"0\n"
    return head + json.dumps(request).encode() + b"\n" if request is not None else head
