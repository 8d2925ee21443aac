"""Where and how to reach a host over SSH, read from an ssh_config the way OpenSSH reads it.

    hop = resolve_hop(load_ssh_config(path), "b300", user=None, port=None, identity=None, jump=None)
    hop.hostname, hop.port, hop.user, hop.key_filenames, hop.gateway (a Hop), hop.proxy_command

paramiko's SSHConfig does the parsing and matching (Host, Match, HostName, %h tokens); this module
turns a lookup into the settings of one connection, with its ProxyJump hops (OpenSSH order: the
first hop is connected first) or ProxyCommand. Explicit inventory settings win over the file.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko


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
    return paramiko.SSHConfig.from_text(Path(path).read_text())


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
