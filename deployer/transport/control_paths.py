"""Where kept connections live and what they are called: the user's private socket directory,
each connection's socket (a hash of everything that decides where and how it connects) and the
DDEPLOY_CONTROL_PERSIST setting. Standard library only (control.py's client loads no paramiko).

    directory = control_dir()          # $DDEPLOY_CONTROL_DIR, $XDG_RUNTIME_DIR/ddeploy or /tmp/ddeploy-UID
    path = socket_in(directory, host)  # DIGEST.sock, one per host entry and ssh_config settings
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConnectError
from .wire import WIRE

if TYPE_CHECKING:
    from ..inventory import Host

DEFAULT_PERSIST = 60.0  # seconds, as Ansible's ControlPersist
# The environment that chooses a host's ssh_config files (ssh.py): part of a connection's name.
CONFIG_SETTINGS = ("DDEPLOY_SSH_CONFIG", "DDEPLOY_SYSTEM_SSH_CONFIG", "DDEPLOY_USER_SSH_CONFIG", "HOME")
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def persist_seconds() -> float:
    """DDEPLOY_CONTROL_PERSIST: how long a connection stays open after its last command (0: off)."""
    raw = os.environ.get("DDEPLOY_CONTROL_PERSIST")
    if not raw:
        return DEFAULT_PERSIST
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 86400:  # also refuses nan and inf
        raise ConnectError(
            f"DDEPLOY_CONTROL_PERSIST={raw!r} is not a number of seconds between 0 and 86400 "
            f"(0 turns connection reuse off)"
        )
    return value


def _chosen_dir() -> tuple[Path, bool]:
    """The directory the settings name, and whether it was named explicitly."""
    explicit = os.environ.get("DDEPLOY_CONTROL_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if explicit:
        return Path(explicit), True
    if runtime:
        return Path(runtime) / "ddeploy", False
    return Path(tempfile.gettempdir()) / f"ddeploy-{os.getuid()}", False


def control_dir() -> Path:
    """The user's private socket directory (created 0700); refused when it is not private."""
    path, explicit = _chosen_dir()
    try:
        path.mkdir(mode=0o700, parents=explicit, exist_ok=True)
        info = path.lstat()  # a symlink planted in /tmp is not followed
    except OSError as exc:
        raise ConnectError(f"cannot use the connection directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        kind = "" if stat.S_ISDIR(info.st_mode) else ", not a directory"
        raise ConnectError(
            f"the connection directory {path} is not private to this user (owner uid {info.st_uid}, "
            f"mode {stat.S_IMODE(info.st_mode):o}{kind}); remove it, or set DDEPLOY_CONTROL_PERSIST=0"
        )
    return path


def absolute_source(host: Host) -> str:
    """The host's inventory file as an absolute path (its directory finds the host's ssh_config)."""
    return host.source if host.source.startswith("<") else os.path.abspath(host.source)


def connection_name(host: Host) -> str:
    """The kept connection's name: a hash of everything that decides where and how it connects."""
    identity = host.ssh.identity if host.ssh else None
    entry = {
        "wire": WIRE,
        "host": host.model_dump(mode="json"),
        "source": absolute_source(host),
        "identity": os.path.abspath(os.path.expanduser(identity)) if identity else None,
        "settings": {k: os.environ.get(k) for k in CONFIG_SETTINGS},
    }
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:24]


def socket_in(directory: Path, host: Host) -> Path:
    return directory / f"{connection_name(host)}.sock"
