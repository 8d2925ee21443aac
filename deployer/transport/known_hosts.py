"""Host keys checked as OpenSSH checks them, on one hop of a connection.

    known = KnownHosts.for_hop(conn)          # conn: a fabric.Connection (its ssh_config lookup)
    conn.client.set_missing_host_key_policy(known.policy(accept_new=False))

The files are the hop's UserKnownHostsFile(s) (default ~/.ssh/known_hosts ~/.ssh/known_hosts2;
`~`, the %-tokens %% %C %d %h %i %k %L %l %n %p %r %u and ${ENV} expanded; `none`: no user files),
then its GlobalKnownHostsFile(s) (default /etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2; `~`
expanded, as ssh does). The name looked up is HostKeyAlias, else the HostName (`[host]:port` off
port 22); hashed names and `*`/`?`/`!` patterns match as in ssh. A key listed for the name in any
file is trusted; a key marked @revoked is refused; another key of the same type and none matching
is a CHANGED key, refused; no key of that type is unknown: refused, or with --accept-new-host-keys
appended to the first user file (hashed when HashKnownHosts is yes).

The client keeps no host keys of its own, so paramiko hands every server key to this policy; the
hop's transport still asks for the key types it knows first (ssh's host key algorithm order).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.hostkeys import HostKeyEntry, HostKeys
from paramiko.ssh_exception import BadHostKeyException, SSHException

USER_DEFAULT = "~/.ssh/known_hosts ~/.ssh/known_hosts2"
GLOBAL_DEFAULT = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"
RSA_ALGORITHMS = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")


def home() -> str:
    """The user's home as ssh finds it (the password database, not $HOME)."""
    return pwd.getpwuid(os.getuid()).pw_dir


def tilde(path: str) -> str:
    return home() + path[1:] if path == "~" or path.startswith("~/") else path


def expand(path: str, tokens: dict[str, str]) -> str:
    """`~`, %-tokens and ${ENV} in a UserKnownHostsFile, as ssh expands them (an unknown token or
    an unset variable is an error there too)."""

    def token(m: re.Match) -> str:
        if m.group(1):
            if m.group(1) not in tokens:
                raise ValueError(f"UserKnownHostsFile {path!r}: unknown token %{m.group(1)}")
            return tokens[m.group(1)]
        if m.group(2) not in os.environ:
            raise ValueError(f"UserKnownHostsFile {path!r}: environment variable {m.group(2)} is not set")
        return os.environ[m.group(2)]

    return re.sub(r"%(.)|\$\{(\w+)\}", token, tilde(path))


def hop_tokens(conn) -> dict[str, str]:
    """The tokens of one hop (a fabric.Connection): local user and host, remote host, port, user."""
    local = socket.gethostname()
    user, host, port = conn.user, conn.host, str(conn.port)
    return {
        "%": "%",
        "C": hashlib.sha1((local + host + port + user).encode()).hexdigest(),  # noqa: S324 - ssh's %C
        "d": home(),
        "h": host,
        "i": str(os.getuid()),
        "k": conn.ssh_config.get("hostkeyalias") or conn.original_host,
        "L": local.split(".")[0],
        "l": local,
        "n": conn.original_host,
        "p": port,
        "r": user,
        "u": pwd.getpwuid(os.getuid()).pw_name,
    }


def _words(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value or []]


def _pattern_matches(patterns: str, name: str) -> bool:
    """ssh's host patterns: comma-separated, `*` and `?` wildcards, `!` negates (and wins)."""
    matched = False
    for pattern in patterns.lower().split(","):
        negated = pattern.startswith("!")
        regex = re.escape(pattern.lstrip("!")).replace(r"\*", ".*").replace(r"\?", ".")
        if re.fullmatch(regex, name.lower()):
            if negated:
                return False
            matched = True
    return matched


def _name_matches(field: str, name: str) -> bool:
    if field.startswith("|1|"):
        return HostKeys.hash_host(name, field) == field
    return _pattern_matches(field, name)


def _parse(line: str) -> tuple[str, str, paramiko.PKey] | None:
    """(marker, names, key) of one known_hosts line; None for comments, blanks and lines paramiko
    cannot read (ssh skips those too)."""
    fields = line.split()
    marker = fields.pop(0) if fields and fields[0].startswith("@") else ""
    if len(fields) < 3 or fields[0].startswith("#"):
        return None
    try:
        entry = HostKeyEntry.from_line(" ".join(fields[:3]))
    except Exception:  # noqa: BLE001 - InvalidHostKey, a bad base64 blob, an unknown key type
        return None
    return (marker, fields[0], entry.key) if entry is not None and entry.key is not None else None


def _same(a: paramiko.PKey, b: paramiko.PKey) -> bool:
    return a.get_name() == b.get_name() and a.asbytes() == b.asbytes()


@dataclass
class KnownHosts:
    """One hop's host key database: the files, the name looked up, and its entries."""

    user_files: list[Path]
    global_files: list[Path]
    name: str
    hash_new: bool = False

    @classmethod
    def for_hop(cls, conn) -> "KnownHosts":
        options = conn.ssh_config
        user = _words(options.get("userknownhostsfile") or USER_DEFAULT)
        user = [] if [w.lower() for w in user] == ["none"] else user
        tokens = hop_tokens(conn)
        alias = options.get("hostkeyalias")
        name = alias or (conn.host if int(conn.port) == 22 else f"[{conn.host}]:{conn.port}")
        return cls(
            user_files=[Path(expand(p, tokens)) for p in user],
            global_files=[Path(tilde(p)) for p in _words(options.get("globalknownhostsfile") or GLOBAL_DEFAULT)],
            name=name,
            hash_new=str(options.get("hashknownhosts", "no")).lower() == "yes",
        )

    def entries(self) -> list[tuple[str, paramiko.PKey]]:
        """(marker, key) for every line naming this host, user files first (ssh's order)."""
        found = []
        for path in [*self.user_files, *self.global_files]:
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:  # missing or unreadable: ssh skips it
                continue
            parsed = (_parse(line) for line in lines)
            found += [(m, key) for m, names, key in filter(None, parsed) if _name_matches(names, self.name)]
        return found

    def key_types(self) -> list[str]:
        """The host key algorithms this hop's known keys need, for the transport to ask first."""
        names = {key.get_name() for marker, key in self.entries() if marker != "@revoked"}
        return [a for n in names for a in (RSA_ALGORITHMS if n == "ssh-rsa" else (n,))]

    def policy(self, accept_new: bool) -> "OpenSSHHostKeyPolicy":
        return OpenSSHHostKeyPolicy(self, accept_new)

    def record(self, key: paramiko.PKey) -> None:
        """Append the key to the first user file (--accept-new-host-keys), as ssh would write it."""
        if not self.user_files:
            raise SSHException(f"Server {self.name!r} not found in known_hosts (UserKnownHostsFile is none)")
        path = self.user_files[0]
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = HostKeys.hash_host(self.name) if self.hash_new else self.name
        lead = "\n" if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n") else ""
        with open(path, "a") as fh:
            fh.write(f"{lead}{name} {key.get_name()} {key.get_base64()}\n")


class OpenSSHHostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Every server key of the hop, judged against all its known-hosts files (see the module)."""

    def __init__(self, known: KnownHosts, accept_new: bool):
        self.known, self.accept_new = known, accept_new

    def missing_host_key(self, client, hostname, key):
        entries = self.known.entries()
        if any(marker == "@revoked" and _same(k, key) for marker, k in entries):
            raise SSHException(f"host key for {self.known.name} is REVOKED in known_hosts")
        listed = [k for marker, k in entries if not marker]
        if any(_same(k, key) for k in listed):
            return
        same_type = [k for k in listed if k.get_name() == key.get_name()]
        if same_type:
            raise BadHostKeyException(hostname, key, same_type[0])
        if not self.accept_new:
            raise SSHException(f"Server {self.known.name!r} not found in known_hosts")
        self.known.record(key)


def transport_preferring(key_types: list[str]):
    """A paramiko transport_factory whose transport asks for these host key types first."""

    def factory(sock, **kwargs) -> paramiko.Transport:
        transport = paramiko.Transport(sock, **kwargs)
        options = transport.get_security_options()
        first = [t for t in options.key_types if t in key_types]
        options.key_types = first + [t for t in options.key_types if t not in first]
        return transport

    return factory
