"""A host's fabric.Connection, set up the way `ssh HOST` would be by OpenSSH.

    config = ssh_config_for(host, timeouts)            # Fabric's Config: which ssh_config files
    conn = connection_chain(config, host, timeouts)    # not connected yet; .gateway = the last jump
    conn.open()                                        # every hop's host key checked strictly

The ssh_config files (read by ssh_config_files.py, `Include` included): the one named for the
host (the host's `ssh.config`, $DDEPLOY_SSH_CONFIG or an inventory-level `ssh_config`) alone, like
`ssh -F`; otherwise the user's file and the system file, the user's first (a setting's first
value wins, as in OpenSSH). $DDEPLOY_USER_SSH_CONFIG and $DDEPLOY_SYSTEM_SSH_CONFIG move those two (tests use them).
Explicit inventory settings win over the files.

What is done here rather than left to Fabric, and why:
- ProxyJump chains are built here: Fabric 3.2 connects `ProxyJump a,b` in reverse (b first),
  OpenSSH connects a first, then b through a. Each hop is a fabric.Connection (`gateway=`).
- Host keys: Fabric's default policy adds unknown keys silently and loads no known_hosts. Every hop
  here is judged against its known-hosts files as ssh reads them (known_hosts.py: every
  UserKnownHostsFile and GlobalKnownHostsFile, tokens expanded) and unknown keys are refused,
  unless --accept-new-host-keys (or the hop's `StrictHostKeyChecking accept-new`, or `no`/`off`,
  read as accept-new) records them in the first user file; a changed key is always refused.
- Keys as OpenSSH offers them, on every hop: the hop's IdentityFile(s) (the inventory's
  `ssh.identity` first for the host itself), the ssh-agent's keys and the default ~/.ssh/id_*
  keys; `IdentitiesOnly yes` leaves out the agent's keys (and the defaults when files are named),
  except the agent's copy of a named key (agent_keys.py: matched by its .pub or the private file's
  public key, so a passphrase-protected key loaded in the agent is used without a prompt).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from fabric import Config, Connection

from ..errors import ConnectError
from .agent_keys import agent_key_for
from .keepalive import Keepalive, alive_settings
from .known_hosts import KnownHosts, transport_preferring
from .ssh_config_files import load_ssh_config

if TYPE_CHECKING:
    from .endpoint import SSHEndpoint
    from .retries import Timeouts


def runtime_ssh_config(host: SSHEndpoint) -> Path | None:
    """The ssh_config named for this host, which replaces the user's and the system's (like
    `ssh -F`): its `ssh.config` (relative to its YAML file), else $DDEPLOY_SSH_CONFIG, else
    `ssh_config` next to the host files; None: the user's and the system's, as OpenSSH reads them."""
    host_dir = Path(host.source).parent if host.source and not host.source.startswith("<") else None
    explicit = host.ssh.config if host.ssh else None
    for cand in (explicit, os.environ.get("DDEPLOY_SSH_CONFIG")):
        if cand:
            path = Path(cand).expanduser()
            if not path.is_absolute() and host_dir is not None:
                path = host_dir / path
            if not path.is_file():
                raise ConnectError(f"ssh_config {path} (from {host.source}) does not exist", host=host.name)
            return path
    beside = host_dir / "ssh_config" if host_dir else None
    return beside if beside is not None and beside.is_file() else None


def ssh_config_for(host: SSHEndpoint, timeouts: Timeouts) -> Config:
    """Fabric's Config for this host: its ssh_config files loaded."""
    runtime = runtime_ssh_config(host)
    system = os.environ.get("DDEPLOY_SYSTEM_SSH_CONFIG", "/etc/ssh/ssh_config")
    user = os.environ.get("DDEPLOY_USER_SSH_CONFIG", "~/.ssh/config")
    try:
        return Config(ssh_config=load_ssh_config(str(runtime) if runtime else None, user, system))
    except (paramiko.SSHException, ValueError, OSError) as exc:  # ConfigParseError, not UTF-8, ...
        raise config_error(host, exc) from None


def config_error(host: SSHEndpoint, exc: Exception) -> ConnectError:
    """An ssh_config that cannot be used (unparsable, `Port abc`, ...), named with its path."""
    runtime = runtime_ssh_config(host)
    where = f"ssh_config {runtime}" if runtime else "the user's or the system's ssh_config"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ConnectError(f"{where} cannot be used for {host.ssh.host}: {type(exc).__name__}: {first}; fix it",
                        host=host.name)  # fmt: skip


DEFAULT_CONNECT_TIMEOUT = 10.0
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def convtime(value: str, option: str = "ConnectTimeout") -> int:
    """An ssh_config time (`30`, `1m30s`) in whole seconds, as ssh reads it; ValueError otherwise."""
    parts = re.findall(r"(\d+)([smhdw]?)", str(value).lower())
    if not parts or "".join(n + u for n, u in parts) != str(value).lower():
        raise ValueError(f"{option} {value!r} is not a time (whole seconds, or e.g. 1m30s)")
    return sum(int(n) * _TIME_UNITS[u] for n, u in parts)


def split_spec(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` or `ssh://user@host:port` (ProxyJump's forms; user and port optional) ->
    (user, host, port)."""
    if spec.lower().startswith("ssh://"):
        spec = spec[len("ssh://") :].rstrip("/")
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:  # a bare IPv6 address has several colons and no port
        host, raw = rest.split(":")
        port = int(raw)
    elif rest.startswith("[") and "]:" in rest:
        host, raw = rest[1:].split("]:")
        port = int(raw)
    return user or None, host, port


def connection_chain(
    config: Config,
    host: SSHEndpoint,
    timeouts: Timeouts,
    *,
    accept_new_host_keys: bool = False,
) -> Connection:
    """The host's Connection (not yet open), through its ProxyJump hops; explicit inventory
    settings (user, port, identity, jump) win over the ssh_config's."""
    spec = host.ssh
    keys = [str(Path(spec.identity).expanduser())] if spec.identity else []
    build = _Builder(config, timeouts, accept_new_host_keys)
    return build.hop(spec.host, user=spec.user, port=spec.port, keys=keys, jump=spec.jump, is_target=True)


class _Builder:
    def __init__(self, config: Config, timeouts: Timeouts, accept_new: bool):
        self.config, self.timeouts, self.accept_new = config, timeouts, accept_new

    def hop(
        self,
        alias: str,
        *,
        user: str | None = None,
        port: int | None = None,
        keys: list[str] | None = None,
        jump: str | None = None,
        gateway: Connection | None = None,
        seen: frozenset[str] = frozenset(),
        is_target: bool = False,
    ) -> Connection:
        """One hop: reached through `gateway` when given, else through its own ProxyJump."""
        options = self.config.base_ssh_config.lookup(alias)
        if gateway is None:
            gateway = self._gateway(alias, options, jump, seen)
        conn = Connection(
            alias,
            user=user,
            port=port,
            config=self.config,
            gateway=gateway,
            connect_timeout=0,  # Fabric's would be whole seconds: the timeout goes in connect_kwargs
            connect_kwargs={**self._auth(options, keys or []), "timeout": self._connect_timeout(options, is_target)},
        )
        conn.connect_timeout = None
        conn.server_alive = alive_settings(options, self.timeouts.keepalive, convtime)  # checked before connecting
        _strict_host_keys(conn, self.accept_new)
        return conn

    def _connect_timeout(self, options, is_target: bool) -> float | None:
        """Seconds for the TCP connect: DDEPLOY_CONNECT_TIMEOUT first for the host itself, the
        hop's ConnectTimeout first for a jump host; else 10 s. `ConnectTimeout 0`: none, as in ssh."""
        own = convtime(options["connecttimeout"]) if "connecttimeout" in options else None
        first, then = (self.timeouts.connect, own) if is_target else (own, self.timeouts.connect)
        seconds = next((s for s in (first, then) if s is not None), DEFAULT_CONNECT_TIMEOUT)
        return seconds or None

    def _gateway(self, alias: str, options, jump: str | None, seen: frozenset[str]):
        """The Connection to reach `alias` through (its last ProxyJump hop), a ProxyCommand
        string, or False (direct). `ProxyJump a,b`: a is connected first, b through a."""
        jumps = jump or options.get("proxyjump")
        if not jumps or jumps.lower() == "none":
            command = options.get("proxycommand")
            return command if command and command.lower() != "none" else False
        seen = seen | {alias, options.get("hostname", alias)}
        gateway = None
        for spec in jumps.split(","):
            user, name, port = split_spec(spec.strip())
            if name in seen:  # a wildcard Host block that names the host as its own jump host
                return False
            gateway = self.hop(name, user=user, port=port, gateway=gateway, seen=seen)
        return gateway

    def _auth(self, options, keys: list[str]) -> dict:
        """paramiko's connect() arguments for one hop (Fabric adds the ssh_config's IdentityFile)."""
        only = str(options.get("identitiesonly", "no")).lower() == "yes"
        named = [*keys, *options.get("identityfile", [])]
        held = agent_key_for(named) if only else None
        return {
            "key_filename": keys,
            "allow_agent": not only,
            "look_for_keys": not (only and named),
            "banner_timeout": self.timeouts.banner,
            "auth_timeout": self.timeouts.auth,
            **({"pkey": held} if held else {}),
        }


_ACCEPT_NEW = {"yes": False, "ask": False, "accept-new": True, "no": True, "off": True}


def _strict_host_keys(conn: Connection, accept_new: bool) -> None:
    """Replace Fabric's auto-adding policy: the hop's known-hosts files, as ssh reads them
    (known_hosts.py), judge its key; unknown keys are refused, or recorded with accept_new or the
    hop's `StrictHostKeyChecking accept-new` (`no`/`off` too: a changed key is never accepted)."""
    strict = str(conn.ssh_config.get("stricthostkeychecking", "yes")).lower()
    if strict not in _ACCEPT_NEW:
        raise ValueError(f"StrictHostKeyChecking {strict!r} is not yes, accept-new, no or ask")
    known = KnownHosts.for_hop(conn)
    conn.client.set_missing_host_key_policy(known.policy(accept_new or _ACCEPT_NEW[strict]))
    conn.connect_kwargs["transport_factory"] = transport_preferring(known.key_types())


def hops(conn: Connection) -> list[Connection]:
    """The chain's Connections, the first one connected first, the host itself last."""
    chain = [conn]
    while isinstance(chain[-1].gateway, Connection):
        chain.append(chain[-1].gateway)
    return chain[::-1]


def target(conn: Connection) -> str:
    """`user@host:port`, with `(via ProxyJump user@jump:port)` for the last hop when there is one."""
    text = f"{conn.user}@{conn.host}:{conn.port}"
    if isinstance(conn.gateway, Connection):
        text += f" (via ProxyJump {conn.gateway.user}@{conn.gateway.host}:{conn.gateway.port})"
    return text


def describe_hop(hop: Connection, conn: Connection) -> str:
    """The chain's hop `hop` in an error: the target as `target` says, a jump host as
    `user@jump:port (ProxyJump hop to user@host:port)`."""
    if hop is conn:
        return target(conn)
    return f"{hop.user}@{hop.host}:{hop.port} (ProxyJump hop to {conn.user}@{conn.host}:{conn.port})"


def keep_alive(hop: Connection) -> Keepalive | None:
    """The open hop's keepalive watcher (its ServerAliveInterval x ServerAliveCountMax), or None: off."""
    interval, count = hop.server_alive
    return Keepalive.start(hop.transport, f"{hop.user}@{hop.host}:{hop.port}", interval, count)


def close_chain(conn: Connection) -> None:
    """Close the host's connection, then the hops it went through (Fabric closes only the first)."""
    for hop in reversed(hops(conn)):
        try:
            hop.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken connection must not raise
            pass
