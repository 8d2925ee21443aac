"""Where and how to reach a host over SSH, read from an ssh_config the way OpenSSH reads it.

    hop = resolve_hop(load_ssh_config(path), "b300", user=None, port=None, identity=None, jump=None)
    hop.hostname, hop.port, hop.user, hop.key_filenames, hop.gateway (a Hop), hop.proxy_command

paramiko's SSHConfig does the parsing and matching (Host, Match, HostName, %h tokens); this module
turns a lookup into the settings of one connection, with its ProxyJump hops (OpenSSH order: the
first hop is connected first) or ProxyCommand. Explicit inventory settings win over the file.
"""

from __future__ import annotations

import getpass
import importlib
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path


def _import_paramiko_without_invoke():
    """paramiko.config imports invoke (~80 ms, with the asyncio it pulls in) only to run `Match
    exec`; import paramiko with invoke held back, and bring invoke in for an ssh_config that has
    `Match exec` (load_ssh_config). paramiko also imports importlib.metadata (~30 ms, with the
    email package) only to read its own version: that comes from its METADATA file instead, so a
    head start (head_start.py) connects that much sooner."""
    held = "invoke" not in sys.modules
    stub = _own_version_only() if "importlib.metadata" not in sys.modules else None
    if held:
        sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` fails fast
    if stub is not None:
        sys.modules["importlib.metadata"] = stub
    try:
        import paramiko
    finally:
        if held:
            del sys.modules["invoke"]  # a later `import invoke` works as usual
        if stub is not None:  # a later `import importlib.metadata` gets the real one
            if sys.modules.get("importlib.metadata") is stub:
                del sys.modules["importlib.metadata"]
            if getattr(importlib, "metadata", None) is stub:
                del importlib.metadata
    return paramiko


def _own_version_only():
    """A stand-in for importlib.metadata whose `version("paramiko")` reads paramiko's METADATA
    file; None when that file is not where pip puts it (then the real module is used)."""
    import importlib.util
    import types

    try:
        spec = importlib.util.find_spec("paramiko")
        site = Path(spec.origin).parent.parent
        (dist,) = site.glob("paramiko-*.dist-info")
        with open(dist / "METADATA", encoding="utf-8") as fh:
            version = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("Version:"))
    except (AttributeError, TypeError, ValueError, OSError, StopIteration):
        return None
    stub = types.ModuleType("importlib.metadata")

    def only_paramiko(name: str) -> str:
        if name != "paramiko":
            raise LookupError(f"{name}: only paramiko's own version is known while it imports")
        return version

    stub.version = only_paramiko
    return stub


paramiko = _import_paramiko_without_invoke()
MATCH_EXEC = re.compile(r"^\s*match\b.*\bexec\b", re.IGNORECASE | re.MULTILINE)

SYSTEM_SSH_CONFIG = Path("/etc/ssh/ssh_config")


@dataclass(frozen=True)
class Hop:
    """One SSH connection: to the host itself, or to a ProxyJump host on the way."""

    alias: str
    hostname: str
    port: int
    user: str
    key_filenames: tuple[str, ...]
    connect_timeout: int | None  # the ssh_config's ConnectTimeout, if any
    options: dict
    gateway: Hop | None = None
    proxy_command: str | None = None

    @property
    def target(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def load_ssh_config(path: Path | None) -> paramiko.SSHConfig:
    """`path` alone (like `ssh -F`), else the system file if there is one."""
    path = path if path is not None else (SYSTEM_SSH_CONFIG if SYSTEM_SSH_CONFIG.is_file() else None)
    if path is None:
        return paramiko.SSHConfig()
    text = Path(path).read_text()
    if MATCH_EXEC.search(text) and paramiko.config.invoke is None:
        try:
            paramiko.config.invoke = importlib.import_module("invoke")  # what runs `Match exec`
        except ImportError:
            pass  # paramiko refuses `Match exec` itself, naming invoke
    return paramiko.SSHConfig.from_text(text)


def split_spec(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` (ProxyJump's form; user and port optional) -> (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:  # a bare IPv6 address has several colons and no port
        host, raw = rest.split(":")
        port = int(raw)
    elif rest.startswith("[") and "]:" in rest:
        host, raw = rest[1:].split("]:")
        port = int(raw)
    return user or None, host, port


def resolve_hop(
    config: paramiko.SSHConfig,
    alias: str,
    *,
    user: str | None = None,
    port: int | None = None,
    identity: str | None = None,
    jump: str | None = None,
    _seen: frozenset[str] = frozenset(),
) -> Hop:
    """The settings for `alias`; explicit arguments win over the ssh_config's."""
    opts = config.lookup(alias)
    hostname = opts.get("hostname", alias)
    keys = ([identity] if identity else []) + list(opts.get("identityfile", []))
    timeout = int(opts["connecttimeout"]) if "connecttimeout" in opts else None
    hop = Hop(
        alias=alias,
        hostname=hostname,
        port=port or int(opts.get("port", 22)),
        user=user or opts.get("user") or getpass.getuser(),
        key_filenames=tuple(keys),
        connect_timeout=timeout,
        options=dict(opts),
    )
    jumps = jump or opts.get("proxyjump")
    if jumps and jumps.lower() != "none":
        return _through(config, hop, jumps.split(","), _seen | {alias, hostname})
    if "proxycommand" in opts and opts["proxycommand"].lower() != "none":
        return replace(hop, proxy_command=opts["proxycommand"])
    return hop


def _through(config: paramiko.SSHConfig, hop: Hop, jumps: list[str], seen: frozenset[str]) -> Hop:
    """`hop` reached through the ProxyJump hosts `jumps`, the first connected first."""
    gateway = None
    for spec in jumps:
        user, host, port = split_spec(spec.strip())
        if host in seen:  # a wildcard Host block that names the host as its own jump host
            return hop
        gw = resolve_hop(config, host, user=user, port=port, _seen=seen)
        gateway = gw if gateway is None else _with_gateway(gw, gateway)
    return replace(hop, gateway=gateway)


def _with_gateway(hop: Hop, gateway: Hop) -> Hop:
    """`hop`, reached through `gateway` (whose own gateway, if any, comes first)."""
    return replace(hop, gateway=gateway if hop.gateway is None else _with_gateway(hop.gateway, gateway))
