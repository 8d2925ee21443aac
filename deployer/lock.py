"""The checkout's lock: a directory `<checkout>/.git/ddeploy/lock` created with an atomic mkdir,
holding `owner.json` ({"by": "user@host", "user", "host", "pid", "time", "command"}). Whoever creates the directory
holds the lock; everyone else gets a LockError naming the holder.

The deploy engine takes the lock on the host itself (deployer/remote/agent.py, same layout);
other commands that change a checkout (kernel builds) can take it from here:

    with held_lock(conn, host, "build sm_120"):
        ...
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .connection import Connection
from .errors import LockError, StateError
from .inventory import Host


def lock_dir(host: Host) -> str:
    return f"{host.checkout.rstrip('/')}/.git/ddeploy/lock"


def owner_info(command: str) -> dict[str, Any]:
    user, host = getpass.getuser(), socket.gethostname()
    return {"by": f"{user}@{host}", "user": user, "host": host, "pid": os.getpid(), "time": time.time(),
            "command": command}


def describe_owner(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "unknown owner (no owner.json)"
    age = time.time() - float(owner.get("time", time.time()))
    return (f"{owner.get('user', '?')}@{owner.get('host', '?')} pid {owner.get('pid', '?')} "
            f"running `{owner.get('command', '?')}` for {age:.0f}s")


def read_lock(conn: Connection, host: Host) -> dict[str, Any] | None:
    """None when free; else the owner record ({} when the directory has no readable owner.json)."""
    res = conn.run(["sh", "-c", 'test -d "$1" || exit 3; cat "$1/owner.json" 2>/dev/null; exit 0', "sh",
                    lock_dir(host)], check=False)
    if res.rc == 3:
        return None
    try:
        owner = json.loads(res.stdout)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def acquire_lock(conn: Connection, host: Host, command: str) -> None:
    path = lock_dir(host)
    conn.run(["mkdir", "-p", path.rsplit("/", 1)[0]])
    if conn.run(["mkdir", path], check=False).rc != 0:
        owner = read_lock(conn, host)
        raise LockError(f"checkout {host.checkout} is locked by {describe_owner(owner)}; wait, or if it is "
                        f"stale run `ddeploy lock release --host {host.name}`", host=host.name)
    conn.run(["sh", "-c", 'cat > "$1/owner.json"', "sh", path],
             input=json.dumps(owner_info(command)).encode())


def release_lock(conn: Connection, host: Host) -> bool:
    """Remove the lock; True when there was one."""
    if read_lock(conn, host) is None:
        return False
    res = conn.run(["rm", "-rf", "--", lock_dir(host)], check=False)
    if res.rc != 0:
        raise StateError(f"cannot remove {lock_dir(host)}: {res.stderr.strip()}", host=host.name)
    return True


@contextmanager
def held_lock(conn: Connection, host: Host, command: str) -> Iterator[None]:
    acquire_lock(conn, host, command)
    try:
        yield
    finally:
        release_lock(conn, host)
